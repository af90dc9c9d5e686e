#include <gtest/gtest.h>
#include <linux/falloc.h>

#include <cstdint>
#include <limits>

#include "fuse/ranges.h"

namespace qcowfs::fuse {
namespace {

constexpr uint64_t kSize = 1 << 20;
constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();

TEST(FuseRanges, ReadsAreShortAtTheEnd) {
  EXPECT_EQ(readable_bytes(0, 4096, kSize), 4096u);
  EXPECT_EQ(readable_bytes(kSize - 100, 4096, kSize), 100u);
  EXPECT_EQ(readable_bytes(kSize, 4096, kSize), 0u);
  EXPECT_EQ(readable_bytes(kSize + 1, 4096, kSize), 0u);
  EXPECT_EQ(readable_bytes(10, kMax, kSize), kSize - 10);
}

TEST(FuseRanges, WritesInsideTheDiskAreWhole) {
  for (auto [off, len] : {std::pair<uint64_t, uint64_t>{0, kSize}, {kSize - 1, 1}, {kSize, 0}, {kMax, 0}}) {
    auto n = writable_bytes(off, len, kSize);
    ASSERT_TRUE(n) << off << "+" << len << ": " << n.status().to_string();
    EXPECT_EQ(*n, len) << off << "+" << len;
  }
}

TEST(FuseRanges, WritesCrossingTheEndAreShort) {
  for (auto [off, len] : {std::pair<uint64_t, uint64_t>{kSize - 1, 2}, {0, kSize + 1}, {1, kMax}, {kSize - 512, 4096}}) {
    auto n = writable_bytes(off, len, kSize);
    ASSERT_TRUE(n) << off << "+" << len << ": " << n.status().to_string();
    EXPECT_EQ(*n, kSize - off) << off << "+" << len;
  }
}

TEST(FuseRanges, WritesAtOrPastTheEndGetEnospc) {
  for (auto [off, len] : {std::pair<uint64_t, uint64_t>{kSize, 1}, {kSize + 1, 4096}, {kMax, 2}}) {
    auto n = writable_bytes(off, len, kSize);
    ASSERT_FALSE(n) << off << "+" << len;
    EXPECT_EQ(n.status().code(), ENOSPC) << off << "+" << len;
  }
}

TEST(FuseRanges, PunchHoleUnmapsAndClampsToTheDisk) {
  auto p = plan_fallocate(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, kSize - 4096, 8192, kSize);
  ASSERT_TRUE(p) << p.status().to_string();
  EXPECT_EQ(p->action, FallocatePlan::Action::zero_unmap);
  EXPECT_EQ(p->offset, kSize - 4096);
  EXPECT_EQ(p->length, 4096u);
}

TEST(FuseRanges, PunchHoleWithoutKeepSizeIsUnsupported) {
  auto p = plan_fallocate(FALLOC_FL_PUNCH_HOLE, 0, 4096, kSize);
  ASSERT_FALSE(p);
  EXPECT_EQ(p.status().code(), EOPNOTSUPP);
}

TEST(FuseRanges, ZeroRangeKeepsAllocation) {
  auto p = plan_fallocate(FALLOC_FL_ZERO_RANGE, 512, 1000, kSize);
  ASSERT_TRUE(p);
  EXPECT_EQ(p->action, FallocatePlan::Action::zero_allocate);
  EXPECT_EQ(p->offset, 512u);
  EXPECT_EQ(p->length, 1000u);
}

TEST(FuseRanges, ZeroRangeGrowingTheDiskGetsEfbigUnlessKeepSize) {
  EXPECT_EQ(plan_fallocate(FALLOC_FL_ZERO_RANGE, kSize - 10, 20, kSize).status().code(), EFBIG);
  auto p = plan_fallocate(FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE, kSize - 10, 20, kSize);
  ASSERT_TRUE(p);
  EXPECT_EQ(p->length, 10u);
}

TEST(FuseRanges, ModeZeroAllocatesNothingInsideAndRefusesToGrow) {
  auto p = plan_fallocate(0, 0, kSize, kSize);
  ASSERT_TRUE(p);
  EXPECT_EQ(p->action, FallocatePlan::Action::nothing);
  EXPECT_EQ(plan_fallocate(0, 0, kSize + 1, kSize).status().code(), EFBIG);
  auto keep = plan_fallocate(FALLOC_FL_KEEP_SIZE, 0, kSize + 1, kSize);
  ASSERT_TRUE(keep);
  EXPECT_EQ(keep->action, FallocatePlan::Action::nothing);
}

TEST(FuseRanges, OtherModesAndEmptyRanges) {
  EXPECT_EQ(plan_fallocate(FALLOC_FL_COLLAPSE_RANGE, 0, 4096, kSize).status().code(), EOPNOTSUPP);
  EXPECT_EQ(plan_fallocate(FALLOC_FL_INSERT_RANGE, 0, 4096, kSize).status().code(), EOPNOTSUPP);
  EXPECT_EQ(plan_fallocate(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 0, kSize).status().code(), EINVAL);
  EXPECT_EQ(plan_fallocate(FALLOC_FL_ZERO_RANGE, kMax, 2, kSize).status().code(), EFBIG);
}

TEST(FuseRanges, PunchHolePastTheEndIsANoOpRange) {
  auto p = plan_fallocate(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, kSize + 4096, 4096, kSize);
  ASSERT_TRUE(p);
  EXPECT_EQ(p->length, 0u);
}

}  // namespace
}  // namespace qcowfs::fuse
