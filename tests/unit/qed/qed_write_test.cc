// The QED writer's own rules (image/qed/writer.h, qed.cc): the need-check bit
// around changes, and what a read-write open does with an image that has it
// set. The write path it shares with the other table formats is tested in
// image_extent_write_test.cc.
#include <gtest/gtest.h>

#include "image/endian.h"
#include "image/qed/format.h"
#include "image/qed/qed.h"
#include "io/mem_file.h"
#include "unit/image/driver_test_fixtures.h"

namespace qcowfs::image {
namespace {

constexpr size_t kFeaturesAt = offsetof(qed::HeaderLayout, features);

class QedWrite : public testing::QemuImageWriteTest {
 protected:
  QedWrite()
      : QemuImageWriteTest(open_qed, fmt::format("/var/tmp/qcowfs-qed-write-{}.qed", ::getpid()),
                           "qemu-img create -q -f qed {0} 8M && qemu-io -f qed -c 'write -P 1 0 4k' {0}") {}
  static uint64_t features(const io::MemFile& f) { return load_le64(f.content().data() + kFeaturesAt); }
};

TEST_F(QedWrite, NeedCheckIsSetBeforeTheFirstAllocationAndClearedOnClose) {
  io::MemFile* file = nullptr;
  auto d = open(&file, good_);
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  std::vector<std::byte> data(4096, std::byte{7});
  ASSERT_TRUE(run((*d)->write(0, data)).is_ok());  // in place: no change of metadata
  EXPECT_EQ(features(*file) & qed::kFeatureNeedCheck, 0u);
  ASSERT_TRUE(run((*d)->write(3 << 20, data)).is_ok());  // allocates
  EXPECT_NE(features(*file) & qed::kFeatureNeedCheck, 0u);
  ASSERT_TRUE(run((*d)->close()).is_ok());
  EXPECT_EQ(features(*file) & qed::kFeatureNeedCheck, 0u);
}

// QEMU checks a need-check image opened read-write; so do we: valid tables
// get the bit cleared, a bad entry refuses the read-write open.
TEST_F(QedWrite, ANeedCheckImageIsCheckedWhenOpenedReadWrite) {
  auto dirty = good_;
  store_le64(dirty.data() + kFeaturesAt, qed::kFeatureNeedCheck);
  io::MemFile* file = nullptr;
  auto d = open(&file, dirty);
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  EXPECT_EQ(features(*file) & qed::kFeatureNeedCheck, 0u);
  ASSERT_TRUE(run((*d)->close()).is_ok());

  const uint64_t l1 = load_le64(dirty.data() + offsetof(qed::HeaderLayout, l1_table_offset));
  const uint64_t l2 = load_le64(dirty.data() + l1);
  auto bad = dirty;
  store_le64(bad.data() + l2 + 8, 0x12345);  // unaligned data cluster offset
  auto refused = open(&file, bad);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_EQ(refused.status().code(), EIO);
  EXPECT_NE(refused.status().message().find("invalid entry 0x12345"), std::string::npos) << refused.status().message();
  EXPECT_NE(refused.status().message().find("qemu-img check -r all"), std::string::npos);
}

}  // namespace
}  // namespace qcowfs::image
