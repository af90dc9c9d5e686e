// image::create_raw(): a new raw image of the size asked for, with host space
// for every byte when preallocated, flushed before it reports success.
#include <gtest/gtest.h>

#include "image/raw/raw.h"
#include "io/mem_file.h"
#include "unit/io/io_test_util.h"

namespace qcowfs::image {
namespace {

using io::testing::run_now;

constexpr uint64_t kSize = 1024 * 1024;

TEST(CreateRaw, SparseImageHasTheSizeAndNoData) {
  io::MemFile f;
  ASSERT_TRUE(run_now(create_raw(f, kSize, false)).is_ok());
  EXPECT_EQ(f.size(), kSize);
  EXPECT_EQ(f.counters().write_zeroes, 0u);
  EXPECT_EQ(f.counters().flushes, 1u);
  EXPECT_EQ(f.unflushed_count(), 0u);
}

TEST(CreateRaw, PreallocatedImageZeroesEveryByte) {
  io::MemFile f;
  ASSERT_TRUE(run_now(create_raw(f, kSize, true)).is_ok());
  EXPECT_EQ(f.size(), kSize);
  EXPECT_EQ(f.counters().write_zeroes, 1u);
  EXPECT_EQ(f.unflushed_count(), 0u);
}

}  // namespace
}  // namespace qcowfs::image
