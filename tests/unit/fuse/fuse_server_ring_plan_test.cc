// plan_ring_queues(): which kernel FUSE io_uring queues each event loop serves.
#include <gtest/gtest.h>

#include <map>
#include <vector>

#include "fuse/server.h"

namespace qcowfs::fuse {
namespace {

using Qids = std::vector<uint16_t>;

// Entries registered per kernel queue, summed over the loops.
std::map<uint16_t, unsigned> entries_per_queue(unsigned loops, unsigned queues) {
  std::map<uint16_t, unsigned> total;
  for (unsigned i = 0; i < loops; ++i) {
    RingPlan p = plan_ring_queues(i, loops, queues);
    EXPECT_FALSE(p.qids.empty()) << "loop " << i << " of " << loops << " on " << queues << " queues";
    for (uint16_t q : p.qids) total[q] += p.depth;
  }
  return total;
}

TEST(RingPlan, OneLoopServesEveryQueue) {
  RingPlan p = plan_ring_queues(0, 1, 4);
  EXPECT_EQ(p.qids, (Qids{0, 1, 2, 3}));
  EXPECT_EQ(p.depth, 64u);
}

TEST(RingPlan, AsManyLoopsAsQueuesEachServesOne) {
  EXPECT_EQ(plan_ring_queues(0, 2, 2).qids, (Qids{0}));
  EXPECT_EQ(plan_ring_queues(1, 2, 2).qids, (Qids{1}));
  EXPECT_EQ(plan_ring_queues(1, 2, 2).depth, 64u);
}

TEST(RingPlan, FewerLoopsThanQueuesShareThemRoundRobin) {
  EXPECT_EQ(plan_ring_queues(0, 3, 8).qids, (Qids{0, 3, 6}));
  EXPECT_EQ(plan_ring_queues(2, 3, 8).qids, (Qids{2, 5}));
}

TEST(RingPlan, MoreLoopsThanQueuesShareTheirEntries) {
  // 4 loops on 2 queues: loops 0 and 2 serve queue 0, 32 entries each.
  EXPECT_EQ(plan_ring_queues(2, 4, 2).qids, (Qids{0}));
  EXPECT_EQ(plan_ring_queues(2, 4, 2).depth, 32u);
  // 3 loops on 2 queues: queue 0 has two loops, queue 1 one.
  EXPECT_EQ(plan_ring_queues(1, 3, 2).depth, 64u);
  EXPECT_EQ(plan_ring_queues(2, 3, 2).depth, 32u);
}

TEST(RingPlan, EveryQueueHasEntriesWhateverTheCounts) {
  for (unsigned queues : {1u, 2u, 3u, 8u}) {
    for (unsigned loops : {1u, 2u, 3u, 4u, 9u, 64u}) {
      auto total = entries_per_queue(loops, queues);
      ASSERT_EQ(total.size(), queues) << loops << " loops";
      for (auto [q, n] : total) EXPECT_GE(n, 64u) << "queue " << q << ", " << loops << " loops";
    }
  }
}

TEST(RingPlan, NoQueuesNoRing) { EXPECT_TRUE(plan_ring_queues(0, 2, 0).qids.empty()); }

}  // namespace
}  // namespace qcowfs::fuse
