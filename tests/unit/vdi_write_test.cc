// The VDI writer's own rules (image/vdi/writer.h, vdi.cc); the write path it
// shares with the other table formats is tested in image_extent_write_test.cc.
#include <gtest/gtest.h>

#include "image/endian.h"
#include "image/vdi/format.h"
#include "image/vdi/vdi.h"
#include "io/mem_file.h"
#include "qcow2_write_test_util.h"

namespace qcowfs::image {
namespace {

using qcow2::testing::read_file;
using qcow2::testing::shell;
using qcow2::testing::write_file;

// Block maps that would make a new block overwrite one in use are refused for
// writing (read-only opens still work).
TEST(VdiWrite, AllocationThatCouldOverwriteABlockIsRefused) {
  auto engine = std::move(*io::make_engine(io::EngineKind::threads));
  auto run = [&](auto t) { return io::run_sync(*engine, std::move(t)); };
  const std::string path_ = fmt::format("/var/tmp/qcowfs-vdi-write-{}.vdi", ::getpid());
  std::string out;
  ASSERT_EQ(shell(fmt::format("qemu-img create -q -f vdi {} 8M", path_), &out), 0) << out;
  ASSERT_EQ(shell(fmt::format("qemu-io -f vdi -c 'write -P 1 0 4k' -c 'write -P 2 1M 4k' {}", path_), &out), 0) << out;
  const auto good = read_file(path_);
  const uint32_t bmap = load_le32(good.data() + offsetof(vdi::HeaderLayout, offset_bmap));
  struct Case {
    const char* what;
    uint64_t at;
    uint32_t value;
    const char* message;
  };
  for (const Case& c :
       {Case{"duplicate", bmap + 4, 0, "named by two blocks"},
        Case{"past blocks_allocated", offsetof(vdi::HeaderLayout, blocks_allocated), 1, "not below blocks_allocated"},
        Case{"above blocks_in_image", offsetof(vdi::HeaderLayout, blocks_allocated), 1000, "above blocks_in_image"}}) {
    auto bad = good;
    store_le32(bad.data() + c.at, c.value);
    write_file(path_, bad);
    io::MemFileOptions mo;
    ImageOptions o;
    o.file.writable = true;
    auto d = run(open_vdi(std::make_unique<io::MemFile>(mo, bad), path_, o));
    ASSERT_FALSE(d.is_ok()) << c.what;
    EXPECT_EQ(d.status().code(), EIO) << c.what;
    EXPECT_NE(d.status().message().find(c.message), std::string::npos) << c.what << ": " << d.status().message();
    EXPECT_NE(d.status().message().find("read-only"), std::string::npos) << d.status().message();
    o.file.writable = false;
    EXPECT_TRUE(run(open_vdi(std::make_unique<io::MemFile>(mo, bad), path_, o)).is_ok()) << c.what;
  }
  ::unlink(path_.c_str());
}

}  // namespace
}  // namespace qcowfs::image
