// InFlightIo (image/extent/in_flight.h): a change's grace period ends only after the
// I/O that entered before it left, never waits for I/O that entered after it,
// and ends under a load that never stops; a threaded run checks that no I/O
// still uses a mapping once drained() says its grace period is over.
#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <thread>
#include <vector>

#include "image/extent/in_flight.h"

namespace qcowfs::image {
namespace {

TEST(InFlightIo, NothingInFlightDrainsAtOnce) {
  InFlightIo io;
  const uint64_t e = io.epoch();
  EXPECT_TRUE(io.drained(e));
  EXPECT_TRUE(io.drained(io.epoch()));
}

TEST(InFlightIo, AnIoFromBeforeTheChangeHoldsItsGracePeriod) {
  InFlightIo io;
  InFlightIo::Ticket before = io.enter();
  const uint64_t e = io.epoch();  // the change
  EXPECT_FALSE(io.drained(e));
  EXPECT_FALSE(io.drained(e));
  before.leave();
  EXPECT_TRUE(io.drained(e));
}

TEST(InFlightIo, IoThatEnteredAfterTheChangeDoesNotHoldIt) {
  InFlightIo io;
  const uint64_t e = io.epoch();
  InFlightIo::Ticket first = io.enter();  // same epoch: counted with the change
  EXPECT_FALSE(io.drained(e));            // moves the epoch on
  InFlightIo::Ticket later = io.enter();  // in the new epoch
  first.leave();
  EXPECT_TRUE(io.drained(e));
  EXPECT_FALSE(io.drained(io.epoch()));  // a newer change waits for `later`
}

// A ticket always in flight, each leaving only after the next entered: the
// grace period still ends.
TEST(InFlightIo, AGracePeriodEndsUnderALoadThatNeverStops) {
  InFlightIo io;
  InFlightIo::Ticket current = io.enter();
  const uint64_t e = io.epoch();
  bool ended = false;
  for (int i = 0; i < 10 && !ended; ++i) {
    ended = io.drained(e);
    InFlightIo::Ticket next = io.enter();
    current = std::move(next);  // the older one leaves
  }
  EXPECT_TRUE(ended);
}

TEST(InFlightIo, MovedAndDefaultTicketsLeaveOnce) {
  InFlightIo io;
  InFlightIo::Ticket none;
  none.leave();
  InFlightIo::Ticket a = io.enter();
  InFlightIo::Ticket b = std::move(a);
  a.leave();  // moved from: nothing
  const uint64_t e = io.epoch();
  EXPECT_FALSE(io.drained(e));
  b.leave();
  b.leave();
  EXPECT_TRUE(io.drained(e));
}

// Threads look up a mapping (one of two slots) inside a ticket and use the
// slot until they leave; the main thread switches the mapping and, once its
// grace period is over, checks that nobody uses the old slot.
TEST(InFlightIo, NoIoUsesAnOldMappingAfterItsGracePeriod) {
  InFlightIo io;
  std::atomic<int> mapping{0};
  std::array<std::atomic<int>, 2> users{};
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([&] {
      while (!stop.load()) {
        InFlightIo::Ticket ticket = io.enter();
        const auto slot = static_cast<size_t>(mapping.load(std::memory_order_acquire));
        users[slot].fetch_add(1);
        for (int spin = 0; spin < 50; ++spin) std::atomic_signal_fence(std::memory_order_seq_cst);
        users[slot].fetch_sub(1);
      }
    });
  }
  int checked = 0;
  for (int round = 0; round < 2000; ++round) {
    const int old = mapping.load();
    mapping.store(1 - old, std::memory_order_release);
    const uint64_t e = io.epoch();
    while (!io.drained(e)) std::this_thread::yield();
    ASSERT_EQ(users[static_cast<size_t>(old)].load(), 0) << "round " << round;
    ++checked;
  }
  stop.store(true);
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(checked, 2000);
}

}  // namespace
}  // namespace qcowfs::image
