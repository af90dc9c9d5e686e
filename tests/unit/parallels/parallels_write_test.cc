// The Parallels writer's own rules (image/parallels/writer.h, parallels.cc):
// the in-use flag, and the images a read-write open refuses. The write path it
// shares with the other table formats is tested in image_extent_write_test.cc.
#include <gtest/gtest.h>

#include "image/endian.h"
#include "image/parallels/format.h"
#include "image/parallels/parallels.h"
#include "io/mem_file.h"
#include "unit/image/driver_test_fixtures.h"

namespace qcowfs::image {
namespace {

class ParallelsWrite : public testing::QemuImageWriteTest {
 protected:
  ParallelsWrite()
      : QemuImageWriteTest(open_parallels, fmt::format("/var/tmp/qcowfs-parallels-write-{}.hds", ::getpid()),
                           "qemu-img create -q -f parallels -o cluster_size=4096 {0} 8M && qemu-io -f parallels "
                           "-c 'write -P 1 0 4k' -c 'write -P 2 1M 4k' {0}") {}
};

TEST_F(ParallelsWrite, InUseWhileOpenReadWriteAndClearedOnClose) {
  io::MemFile* file = nullptr;
  auto d = open(&file, good_, true);
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  EXPECT_EQ(load_le32(file->content().data() + parallels::kInuseOff), parallels::kInuseMagic);
  EXPECT_EQ(file->durable_content().size(), file->content().size());
  std::vector<std::byte> data(4096, std::byte{9});
  ASSERT_TRUE(run((*d)->write(5 << 20, data)).is_ok());
  ASSERT_TRUE(run((*d)->close()).is_ok());
  EXPECT_EQ(load_le32(file->content().data() + parallels::kInuseOff), 0u);
}

TEST_F(ParallelsWrite, ImagesAWriteCouldSpoilAreRefusedReadWrite) {
  // 4 KiB clusters: the BAT of 2048 entries spans clusters 0 to 2 of the file.
  const uint32_t cluster0 = load_le32(good_.data() + parallels::kBatOff);
  struct Case {
    const char* what;
    size_t at;
    uint32_t value;
    const char* message;
  };
  for (const Case& c : {Case{"in use", parallels::kInuseOff, parallels::kInuseMagic, "not closed correctly"},
                        Case{"entry on the BAT", parallels::kBatOff + 4, 1, "on the header and BAT"},
                        Case{"overlapping entries", parallels::kBatOff + 4, cluster0, "overlapping clusters"},
                        Case{"format extension", parallels::kExtOffOff, 0, "format extension"}}) {
    auto bad = good_;
    store_le32(bad.data() + c.at, c.value);
    if (std::string(c.what) == "format extension") store_le64(bad.data() + c.at, 2048);
    io::MemFile* file = nullptr;  // freed with the failed open
    auto d = open(&file, bad, true);
    ASSERT_FALSE(d.is_ok()) << c.what;
    EXPECT_EQ(d.status().code(), EROFS) << c.what;
    EXPECT_NE(d.status().message().find(c.message), std::string::npos) << c.what << ": " << d.status().message();
    EXPECT_NE(d.status().message().find("read-only"), std::string::npos) << d.status().message();
  }
}

}  // namespace
}  // namespace qcowfs::image
