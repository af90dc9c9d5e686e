#include "fuse/open_file.h"

#include <gtest/gtest.h>

#include <utility>
#include <vector>

namespace qcowfs::fuse {
namespace {

using Gaps = std::vector<std::pair<uint64_t, uint64_t>>;

Gaps gaps_of(OpenFile& f) {
  Gaps out;
  for (const OpenFile::Range& r : f.take_gaps()) out.emplace_back(r.offset, r.length);
  return out;
}

TEST(FuseOpenFile, ASequentialCopyLeavesNoGap) {
  OpenFile f(true);
  for (uint64_t off = 0; off < 8 << 20; off += 1 << 20) f.note_written(off, 1 << 20);
  EXPECT_EQ(gaps_of(f), Gaps{});
}

TEST(FuseOpenFile, SkippedRangesBeforeTheLastWriteAreGaps) {
  OpenFile f(true);
  f.note_written(4096, 4096);      // a leading hole [0, 4096)
  f.note_written(65536, 100);      // a hole in the middle
  f.note_written(8192, 1000);      // out of order
  EXPECT_EQ(gaps_of(f), (Gaps{{0, 4096}, {9192, 65536 - 9192}}));
  EXPECT_EQ(gaps_of(f), Gaps{}) << "gaps are taken once";
  f.note_written(1 << 20, 512);
  EXPECT_EQ(gaps_of(f), (Gaps{{65636, (1 << 20) - 65636}}));
}

TEST(FuseOpenFile, OverlappingAndTouchingWritesMerge) {
  OpenFile f(true);
  f.note_written(100, 100);
  f.note_written(300, 100);
  f.note_written(150, 200);  // bridges both
  f.note_written(400, 10);   // touches the end
  f.note_written(0, 100);    // touches the start
  EXPECT_EQ(gaps_of(f), Gaps{});
}

TEST(FuseOpenFile, AnOpenWithoutOTruncRecordsNothing) {
  OpenFile f(false);
  f.note_written(1 << 20, 4096);
  EXPECT_EQ(gaps_of(f), Gaps{});
}

TEST(FuseOpenFile, TooScatteredAWriterStopsTrackingAndZeroesNothing) {
  OpenFile f(true);
  for (uint64_t i = 1; i <= kMaxTrackedRanges + 1; ++i) f.note_written(i * 8192, 512);
  EXPECT_TRUE(f.overflowed());
  EXPECT_EQ(gaps_of(f), Gaps{});
  f.note_written(0, 512);
  EXPECT_EQ(gaps_of(f), Gaps{});
}

TEST(FuseOpenFile, ATruncationToZeroRecordsAgainAfterAnOverflow) {
  // note_written() skips the mutex while the open records nothing (an atomic
  // flag): the truncation must turn recording back on.
  OpenFile f(true);
  for (uint64_t i = 1; i <= kMaxTrackedRanges + 1; ++i) f.note_written(i * 8192, 512);
  ASSERT_TRUE(f.overflowed());
  f.truncate_to_zero();
  EXPECT_FALSE(f.overflowed());
  f.note_written(8192, 4096);
  EXPECT_EQ(gaps_of(f), (Gaps{{0, 8192}}));
}

TEST(FuseOpenFile, ATruncationToZeroMakesAnOpenTruncating) {
  OpenFile f(false);
  f.note_written(0, 4096);  // before the truncation: forgotten by it
  EXPECT_FALSE(f.truncating());
  f.truncate_to_zero();
  EXPECT_TRUE(f.truncating());
  f.note_written(8192, 4096);
  EXPECT_EQ(gaps_of(f), (Gaps{{0, 8192}}));
}

TEST(FuseOpenFile, TheSizeSetAfterTruncatingIsZeroedUpTo) {
  // qemu-img's raw create: ftruncate(0), ftruncate(size), a write of its first
  // block, close; the source's data comes through another open.
  OpenFile f(false);
  f.truncate_to_zero();
  f.set_size(4 << 20);
  f.note_written(0, 4096);
  EXPECT_EQ(gaps_of(f), (Gaps{{4096, (4 << 20) - 4096}}));
  EXPECT_EQ(gaps_of(f), Gaps{}) << "gaps are taken once";
}

TEST(FuseOpenFile, TheEndIsTheFurtherOfTheSizeAndTheLastWrite) {
  OpenFile f(true);
  f.set_size(65536);
  f.note_written(1 << 20, 512);
  EXPECT_EQ(gaps_of(f), (Gaps{{0, 1 << 20}}));
  f.set_size(4096);  // a smaller size: nothing past it is zeroed
  EXPECT_EQ(gaps_of(f), Gaps{});
}

TEST(FuseOpenFile, ASizeSetWithoutTruncatingZeroesNothing) {
  OpenFile f(false);
  f.set_size(1 << 20);
  f.note_written(65536, 512);
  EXPECT_EQ(gaps_of(f), Gaps{});
  EXPECT_FALSE(f.truncating());
}

TEST(FuseOpenFile, ATruncationToZeroAgainStartsOver) {
  OpenFile f(true);
  for (uint64_t i = 1; i <= kMaxTrackedRanges + 1; ++i) f.note_written(i * 8192, 512);
  EXPECT_TRUE(f.overflowed());
  f.truncate_to_zero();
  EXPECT_FALSE(f.overflowed());
  f.set_size(8192);
  EXPECT_EQ(gaps_of(f), (Gaps{{0, 8192}}));
}

}  // namespace
}  // namespace qcowfs::fuse
