// RangeLock and IovCursor tests: which ranges conflict, every waiter getting
// its turn (one exclusive holder at a time), and iovec walking across short
// transfers.
#include <gtest/gtest.h>

#include "io/engine.h"
#include "io/iov.h"
#include "io/range_lock.h"
#include "io_test_util.h"

namespace qcowfs::io {
namespace {

class RangeLockTest : public testing::ThreadsEngineTest {
 protected:
  // Starts a coroutine taking [s, e) and recording when it holds the lock.
  void take(uint64_t s, uint64_t e, RangeLock::Mode m, bool* held, RangeLock::Guard* out) {
    auto t = [](RangeLock& l, uint64_t s2, uint64_t e2, RangeLock::Mode m2, bool* h, RangeLock::Guard* o) -> Task<void> {
      *o = co_await l.lock(s2, e2, m2);
      *h = true;
    };
    spawn(t(lock_, s, e, m, held, out));
  }
  RangeLock lock_;
};

TEST_F(RangeLockTest, SharedRangesOverlapFreely) {
  bool a = false, b = false;
  RangeLock::Guard ga, gb;
  take(0, 100, RangeLock::Mode::shared, &a, &ga);
  take(50, 150, RangeLock::Mode::shared, &b, &gb);
  settle();
  EXPECT_TRUE(a && b);
  EXPECT_EQ(lock_.held(), 2u);
}

TEST_F(RangeLockTest, TryLockTakesOnlyWhatNothingHolds) {
  RangeLock::Guard ex = lock_.try_lock(0, 4096, RangeLock::Mode::exclusive);
  ASSERT_TRUE(ex.owns());
  EXPECT_FALSE(lock_.try_lock(100, 200, RangeLock::Mode::shared).owns());
  RangeLock::Guard other = lock_.try_lock(4096, 8192, RangeLock::Mode::exclusive);
  EXPECT_TRUE(other.owns());
  // A waiter queued behind a holder taken by try_lock is woken by its release.
  bool b = false;
  RangeLock::Guard gb;
  take(0, 10, RangeLock::Mode::shared, &b, &gb);
  settle();
  EXPECT_FALSE(b);
  ex.release();
  settle();
  EXPECT_TRUE(b);
  EXPECT_EQ(lock_.held(), 2u);
}

TEST_F(RangeLockTest, ExclusiveWaitsForOverlappingHolderOnly) {
  bool a = false, b = false, c = false;
  RangeLock::Guard ga, gb, gc;
  take(0, 4096, RangeLock::Mode::shared, &a, &ga);
  take(4095, 8192, RangeLock::Mode::exclusive, &b, &gb);     // overlaps by one byte
  take(4096 * 4, 4096 * 5, RangeLock::Mode::exclusive, &c, &gc);  // disjoint
  settle();
  EXPECT_TRUE(a);
  EXPECT_FALSE(b);
  EXPECT_TRUE(c);
  ga.release();
  settle();
  EXPECT_TRUE(b);
}

TEST_F(RangeLockTest, SharedWaitsForExclusiveAndAdjacentRangesDoNotConflict) {
  bool a = false, b = false, c = false;
  RangeLock::Guard ga, gb, gc;
  take(100, UINT64_MAX, RangeLock::Mode::exclusive, &a, &ga);
  take(0, 100, RangeLock::Mode::shared, &b, &gb);  // ends where the exclusive one starts
  take(1 << 30, (1 << 30) + 1, RangeLock::Mode::shared, &c, &gc);
  settle();
  EXPECT_TRUE(a && b);
  EXPECT_FALSE(c);
  ga = RangeLock::Guard();  // move-assigning releases
  settle();
  EXPECT_TRUE(c);
  EXPECT_EQ(lock_.held(), 2u);
}

TEST_F(RangeLockTest, ManyWaitersAllEventuallyHoldInTurn) {
  constexpr int kN = 20;
  bool held[kN] = {};
  RangeLock::Guard guards[kN];
  for (int i = 0; i < kN; ++i) take(0, 10, RangeLock::Mode::exclusive, &held[i], &guards[i]);
  for (int round = 0; round < kN; ++round) {
    settle();
    int holders = 0, idx = -1;
    for (int i = 0; i < kN; ++i)
      if (held[i] && guards[i].owns()) ++holders, idx = i;
    ASSERT_EQ(holders, 1) << "round " << round;
    guards[idx].release();
  }
  EXPECT_EQ(lock_.held(), 0u);
  for (bool h : held) EXPECT_TRUE(h);
}

TEST(IovCursor, WalksAcrossShortTransfers) {
  char a[3], b[5], c[7];
  iovec iov[] = {{a, 3}, {b, 5}, {c, 7}};
  IovCursor cur(iov);
  EXPECT_EQ(cur.segments(10).size(), 3u);
  EXPECT_EQ(cur.segments(2).size(), 2u);
  cur.advance(4);  // all of a, one byte of b
  auto s = cur.segments(10);
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[0].iov_base, b + 1);
  EXPECT_EQ(s[0].iov_len, 4u);
  cur.advance(4);  // the rest of b exactly
  s = cur.segments(10);
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].iov_base, c);
  cur.advance(6);
  s = cur.segments(10);
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].iov_base, c + 6);
  EXPECT_EQ(s[0].iov_len, 1u);
  EXPECT_EQ(iov_total(iov), 15u);
}

TEST(IovCursor, GatherAndScatterCopies) {
  std::byte src[6] = {std::byte{1}, std::byte{2}, std::byte{3}, std::byte{4}, std::byte{5}, std::byte{6}};
  std::byte x[2], y[4];
  iovec iov[] = {{x, 2}, {y, 4}};
  copy_to_iov(iov, src, 5);
  EXPECT_EQ(x[1], std::byte{2});
  EXPECT_EQ(y[2], std::byte{5});
  std::byte back[6] = {};
  copy_from_iov(back, iov, 5);
  EXPECT_EQ(back[4], std::byte{5});
  EXPECT_EQ(back[5], std::byte{0});
}

}  // namespace
}  // namespace qcowfs::io
