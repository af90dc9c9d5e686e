// LiveDriver (fuse/live_driver.h): pause() waits for the calls already
// admitted, calls made while paused wait (they neither fail nor reach the
// driver) and run on the driver put in place when resume() lets them in; a
// failed reopen (no driver) fails calls with its reason; a replaced driver is
// destroyed once its calls have drained (and no snapshot view holds it); a
// mapped read (map_read) is a call of the gate: its run keeps the count until
// dropped, and a paused gate gives none.
#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <string>

#include "fuse/live_driver.h"
#include "image/forwarding_driver.h"
#include "io/engine.h"
#include "io/sync.h"
#include "unit/image/fake_driver.h"

namespace qcowfs::fuse {
namespace {

// Counts writes; each write waits for `gate` once it is armed. Every other
// call goes to a FakeDriver of 1 MiB.
class HeldDriver final : public image::ForwardingDriver {
 public:
  HeldDriver() : ForwardingDriver(std::make_shared<fakes::FakeDriver>(1 << 20, false)) {}
  ~HeldDriver() override {
    if (destroyed) *destroyed = true;
  }
  Task<Status> write(uint64_t, std::span<const std::byte>) override {
    ++started;
    if (hold) co_await gate.wait();
    ++finished;
    co_return Status::ok();
  }

  // A run at host offset off + 7 whose one hold logs 'i' when released.
  std::optional<image::MappedRead> map_read(uint64_t off, uint64_t) override {
    ++mapped;
    image::MappedRead run(nullptr, off + 7);
    run.keep(io::Hold([](void* log, uint64_t) { static_cast<std::string*>(log)->push_back('i'); }, &released, 0));
    return run;
  }

  bool hold = false;
  int mapped = 0;
  std::string released;  // 'i' per inner hold released
  bool* destroyed = nullptr;  // set on destruction
  io::AsyncEvent gate;
  int started = 0;
  int finished = 0;
};

class LiveDriverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto e = io::make_engine(io::EngineKind::threads);
    ASSERT_TRUE(e.is_ok());
    engine_ = std::move(*e);
    scope_ = std::make_unique<io::ScopedEngine>(engine_.get());
    auto first = std::make_unique<HeldDriver>();
    first_ = first.get();
    live_ = std::make_unique<LiveDriver>(std::move(first));
  }
  void TearDown() override { scope_.reset(); }
  void settle() {
    for (int i = 0; i < 10; ++i) engine_->run_once(0);
  }
  void write(Status* out, bool* done) {
    auto t = [](LiveDriver& d, Status* o, bool* dn) -> Task<void> {
      static const std::byte byte{};
      *o = co_await d.write(0, std::span<const std::byte>(&byte, 1));
      *dn = true;
    };
    spawn(t(*live_, out, done));
  }
  void pause(bool* done) {
    auto t = [](LiveDriver& d, bool* dn) -> Task<void> {
      co_await d.pause();
      *dn = true;
    };
    spawn(t(*live_, done));
  }

  std::unique_ptr<io::Engine> engine_;
  std::unique_ptr<io::ScopedEngine> scope_;
  HeldDriver* first_ = nullptr;
  std::unique_ptr<LiveDriver> live_;
};

TEST_F(LiveDriverTest, PauseDrainsAdmittedCallsAndQueuesNewOnesForTheNextDriver) {
  first_->hold = true;
  Status a_st, b_st;
  bool a = false, b = false, paused = false;
  write(&a_st, &a);
  settle();
  EXPECT_EQ(first_->started, 1);
  pause(&paused);
  settle();
  EXPECT_FALSE(paused);  // the admitted write is still running
  write(&b_st, &b);
  settle();
  EXPECT_EQ(first_->started, 1);  // queued, not admitted
  first_->gate.set();
  settle();
  EXPECT_TRUE(a && a_st.is_ok());
  EXPECT_TRUE(paused);
  EXPECT_FALSE(b);
  EXPECT_EQ(first_->finished, 1);
  auto second = std::make_unique<HeldDriver>();
  HeldDriver* next = second.get();
  live_->replace(std::move(second));  // first_ is destroyed here
  live_->resume();
  settle();
  EXPECT_TRUE(b && b_st.is_ok());
  EXPECT_EQ(next->finished, 1);  // b went to the new driver
}

TEST_F(LiveDriverTest, AReplacedDriverIsDestroyedOnceItsCallsHaveDrained) {
  bool destroyed = false;
  first_->destroyed = &destroyed;
  first_->hold = true;
  Status st;
  bool written = false, paused = false;
  write(&st, &written);
  settle();
  pause(&paused);
  settle();
  EXPECT_FALSE(paused);
  EXPECT_FALSE(destroyed);  // a write still runs on it
  first_->gate.set();
  settle();
  ASSERT_TRUE(paused && written && st.is_ok());
  live_->replace(std::make_unique<HeldDriver>());
  EXPECT_TRUE(destroyed);  // nothing holds it: freed at the swap, not at unmount
  live_->resume();
}

TEST_F(LiveDriverTest, ASnapshotViewHoldsTheDriverItWasOpenedFrom) {
  bool destroyed = false;
  first_->destroyed = &destroyed;
  // FakeDriver has no snapshots: open_snapshot's default fails, so give the
  // view a driver whose open_snapshot succeeds.
  class WithSnapshot final : public image::ForwardingDriver {
   public:
    explicit WithSnapshot(std::unique_ptr<image::BlockDriver> d) : ForwardingDriver(std::move(d)) {}
    Task<Result<std::unique_ptr<image::BlockDriver>>> open_snapshot(std::string) override {
      co_return std::unique_ptr<image::BlockDriver>(std::make_unique<fakes::FakeDriver>(4096, true));
    }
  };
  bool paused = false;
  pause(&paused);
  settle();
  ASSERT_TRUE(paused);
  bool wrapped_destroyed = false;
  auto held = std::make_unique<HeldDriver>();
  held->destroyed = &wrapped_destroyed;
  live_->replace(std::make_unique<WithSnapshot>(std::move(held)));
  EXPECT_TRUE(destroyed);
  live_->resume();
  std::unique_ptr<image::BlockDriver> view;
  auto open = [](LiveDriver& d, std::unique_ptr<image::BlockDriver>* out) -> Task<void> {
    auto v = co_await d.open_snapshot("s1");
    if (v) *out = std::move(*v);
  };
  spawn(open(*live_, &view));
  settle();
  ASSERT_TRUE(view);
  paused = false;
  pause(&paused);
  settle();
  ASSERT_TRUE(paused);
  live_->replace(std::make_unique<HeldDriver>());
  live_->resume();
  EXPECT_FALSE(wrapped_destroyed);  // the view still borrows it
  EXPECT_EQ(view->size(), 4096u);
  view.reset();
  EXPECT_TRUE(wrapped_destroyed);
}

TEST_F(LiveDriverTest, NoDriverAfterAFailedReopenFailsCallsWithItsReason) {
  bool paused = false;
  pause(&paused);
  settle();
  ASSERT_TRUE(paused);
  live_->replace(nullptr, Status::error(EIO, "reopening x: gone"));
  live_->resume();
  Status st;
  bool done = false;
  write(&st, &done);
  settle();
  ASSERT_TRUE(done);
  EXPECT_EQ(st.code(), EIO);
  EXPECT_EQ(st.message(), "reopening x: gone");
  EXPECT_TRUE(live_->read_only());
}

}  // namespace
}  // namespace qcowfs::fuse

namespace qcowfs::fuse {
namespace {

TEST_F(LiveDriverTest, AMappedReadHoldsTheGateUntilDroppedAndNoneIsGivenWhilePaused) {
  std::optional<image::MappedRead> run = live_->map_read(4096, 512);
  ASSERT_TRUE(run.has_value());
  EXPECT_EQ(run->host_offset, 4096u + 7);
  EXPECT_EQ(first_->mapped, 1);
  bool paused = false;
  pause(&paused);
  settle();
  EXPECT_FALSE(paused);  // the run's read is still admitted
  EXPECT_FALSE(live_->map_read(0, 512).has_value());  // closed gate: read() queues instead
  EXPECT_EQ(first_->mapped, 1);                       // not asked
  run.reset();
  EXPECT_EQ(first_->released, "i");
  settle();
  EXPECT_TRUE(paused);
  live_->resume();
  EXPECT_TRUE(live_->map_read(0, 512).has_value());  // open again
}

TEST_F(LiveDriverTest, AMappedReadWithNoRoomForTheGateHoldIsRefused) {
  class FullDriver final : public image::ForwardingDriver {
   public:
    FullDriver() : ForwardingDriver(std::make_shared<fakes::FakeDriver>(1 << 20, false)) {}
    std::optional<image::MappedRead> map_read(uint64_t, uint64_t) override {
      image::MappedRead run(nullptr, 0);
      for (size_t i = 0; i < image::MappedRead::kMaxHolds; ++i)
        run.keep(io::Hold([](void* n, uint64_t) { ++*static_cast<int*>(n); }, &released, 0));
      return run;
    }
    int released = 0;
  };
  auto full = std::make_unique<FullDriver>();
  FullDriver* inner = full.get();
  LiveDriver live(std::move(full));
  EXPECT_FALSE(live.map_read(0, 512).has_value());
  EXPECT_EQ(inner->released, static_cast<int>(image::MappedRead::kMaxHolds));
  bool paused = false;
  auto t = [](LiveDriver& d, bool* dn) -> Task<void> {
    co_await d.pause();
    *dn = true;
  };
  spawn(t(live, &paused));
  settle();
  EXPECT_TRUE(paused);  // the refused run left the gate
  live.resume();
}

}  // namespace
}  // namespace qcowfs::fuse
