// Task tests: values and Status travel back through co_await; spawn and
// spawn_then start at once; runs of awaits that complete synchronously do not
// nest stack frames (the handoff in io/task.h), checked on a small stack; a
// task that finishes on another loop thread resumes its awaiter there.
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include <gtest/gtest.h>

#include "io/engine.h"
#include "io/run_sync.h"
#include "io/status.h"
#include "io/sync.h"
#include "io/task.h"

namespace qcowfs::io {
namespace {

// How far below the first await any later await of a sequential run may reach.
// A few frames at most are legitimate; nesting one frame set per await passes
// this long before a 256 KiB stack overflows.
constexpr size_t kMaxStackGrowth = 16 * 1024;
constexpr size_t kSmallStack = 256 * 1024;

// Runs fn on a new thread whose stack is only stack_bytes, and waits for it.
bool run_on_small_stack(size_t stack_bytes, std::function<void()> fn) {
  pthread_attr_t attr;
  if (pthread_attr_init(&attr) != 0) return false;
  bool ok = pthread_attr_setstacksize(&attr, stack_bytes) == 0;
  pthread_t thread;
  auto body = [](void* arg) -> void* {
    (*static_cast<std::function<void()>*>(arg))();
    return nullptr;
  };
  ok = ok && pthread_create(&thread, &attr, body, &fn) == 0;
  pthread_attr_destroy(&attr);
  return ok && pthread_join(thread, nullptr) == 0;
}

uintptr_t frame_address() {
  return reinterpret_cast<uintptr_t>(__builtin_frame_address(0));
}

// Completes without suspending; reports where on the stack it ran.
Task<uintptr_t> stack_probe() { co_return frame_address(); }

// The deepest any of `count` sequential synchronous awaits ran below the first
// one (stacks grow down). Stops early once that passes kMaxStackGrowth.
Task<size_t> deepest_sequential_await(int count) {
  const uintptr_t first = co_await stack_probe();
  size_t deepest = 0;
  for (int i = 1; i < count && deepest <= kMaxStackGrowth; ++i) {
    const uintptr_t here = co_await stack_probe();
    if (here < first) deepest = std::max(deepest, static_cast<size_t>(first - here));
  }
  co_return deepest;
}

Task<uint64_t> ready_value(uint64_t v) { co_return v * 3 + 1; }

// Awaits `inner` synchronous tasks and returns the sum of their values.
Task<uint64_t> sum_of_ready(uint64_t base, int inner) {
  uint64_t sum = 0;
  for (int i = 0; i < inner; ++i) sum += co_await ready_value(base + static_cast<uint64_t>(i));
  co_return sum;
}

TEST(Task, MillionSynchronousAwaitsDoNotNestOnASmallStack) {
  constexpr int kAwaits = 1'000'000;
  bool finished = false;
  size_t deepest = 0;
  ASSERT_TRUE(run_on_small_stack(kSmallStack, [&] {
    // Everything completes synchronously: spawn_then runs it to the end inline.
    spawn_then(deepest_sequential_await(kAwaits), [&](size_t d) {
      deepest = d;
      finished = true;
    });
  }));
  ASSERT_TRUE(finished);
  EXPECT_LE(deepest, kMaxStackGrowth) << "sequential awaits nested stack frames";
}

TEST(Task, NestedLoopsOfSynchronousAwaitsSumCorrectlyOnASmallStack) {
  constexpr int kOuter = 1000, kInner = 1000;
  auto outer = []() -> Task<uint64_t> {
    uint64_t total = 0;
    for (int o = 0; o < kOuter; ++o) total += co_await sum_of_ready(static_cast<uint64_t>(o) * kInner, kInner);
    co_return total;
  };
  uint64_t expected = 0;
  for (uint64_t v = 0; v < uint64_t{kOuter} * kInner; ++v) expected += v * 3 + 1;
  std::optional<uint64_t> got;
  ASSERT_TRUE(run_on_small_stack(kSmallStack, [&] { spawn_then(outer(), [&](uint64_t v) { got = v; }); }));
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(*got, expected);
}

// Suspends on the engine (a trivial offloaded call), then returns v.
Task<int> after_offload(int v) {
  int64_t r = co_await offload([v] { return static_cast<int64_t>(v); });
  co_return static_cast<int>(r);
}

TEST(Task, SynchronousAwaitsAfterAnAsynchronousOneStayShallow) {
  auto engine = make_engine(EngineKind::automatic);
  ASSERT_TRUE(engine.is_ok()) << engine.status().to_string();
  constexpr int kRounds = 100, kAwaitsPerRound = 1000;
  auto task = []() -> Task<std::pair<size_t, int>> {
    size_t deepest = 0;
    int offloaded = 0;
    for (int round = 0; round < kRounds && deepest <= kMaxStackGrowth; ++round) {
      offloaded += co_await after_offload(round);  // resumed from the engine loop
      const uintptr_t first = co_await stack_probe();
      for (int i = 1; i < kAwaitsPerRound; ++i) {
        const uintptr_t here = co_await stack_probe();
        if (here < first) deepest = std::max(deepest, static_cast<size_t>(first - here));
      }
    }
    co_return std::pair{deepest, offloaded};
  };
  int expected_offloaded = 0;
  for (int round = 0; round < kRounds; ++round) expected_offloaded += round;
  auto [deepest, offloaded] = run_sync(**engine, task());
  EXPECT_LE(deepest, kMaxStackGrowth) << "sequential awaits nested stack frames";
  EXPECT_EQ(offloaded, expected_offloaded);
}

// A second event loop on its own thread, stopped and joined in the destructor.
class SecondLoop {
 public:
  SecondLoop() {
    auto e = make_engine(EngineKind::automatic);
    if (!e.is_ok()) return;
    engine_ = std::move(*e);
    thread_ = std::thread([this] {
      ScopedEngine scope(engine_.get());
      id_ = std::this_thread::get_id();
      ready_ = true;
      while (!stop_) engine_->run_once(20);
    });
    while (!ready_) std::this_thread::yield();
  }
  ~SecondLoop() {
    if (!thread_.joinable()) return;
    stop_ = true;
    thread_.join();
  }
  SecondLoop(const SecondLoop&) = delete;
  SecondLoop& operator=(const SecondLoop&) = delete;
  Engine* engine() const { return engine_.get(); }
  std::thread::id id() const { return id_; }

 private:
  std::unique_ptr<Engine> engine_;
  std::thread thread_;
  std::thread::id id_;
  std::atomic<bool> ready_{false}, stop_{false};
};

// Moves to `there` and finishes on that loop's thread.
Task<std::string> finish_on(Engine* there, int v) {
  co_await switch_to(there);
  co_return "value " + std::to_string(v);
}

// Moves to `there`, waits until the loop `home` has run a posted function (so
// the awaiter, which started this task on `home`, has suspended and unwound),
// then finishes on `there`.
Task<std::string> finish_on_after_awaiter_suspended(Engine* home, Engine* there, int v) {
  co_await switch_to(there);
  auto home_ran = std::make_shared<std::atomic<bool>>(false);
  home->post([home_ran] { home_ran->store(true); });
  while (!home_ran->load()) std::this_thread::yield();
  co_return "value " + std::to_string(v);
}

TEST(Task, TaskFinishingOnAnotherLoopAfterItsAwaiterSuspendedResumesItThere) {
  auto first = make_engine(EngineKind::automatic);
  ASSERT_TRUE(first.is_ok()) << first.status().to_string();
  SecondLoop second;
  ASSERT_NE(second.engine(), nullptr);
  Engine* home = first->get();
  auto task = [&]() -> Task<std::pair<std::string, std::thread::id>> {
    std::string got = co_await finish_on_after_awaiter_suspended(home, second.engine(), 7);
    std::thread::id resumed_on = std::this_thread::get_id();
    co_await switch_to(home);
    co_return std::pair{std::move(got), resumed_on};
  };
  auto [got, resumed_on] = run_sync(*home, task());
  EXPECT_EQ(got, "value 7");
  EXPECT_EQ(resumed_on, second.id());
}

// The task finishes on the second loop while its awaiter is still deciding
// whether to suspend: both orders of the handoff happen over many rounds (the
// awaiter then goes on on either thread), and the result written on one
// thread must be read intact on the other (TSan checks the ordering in the
// tsan preset).
TEST(Task, ManyTasksFinishingOnAnotherLoopRaceTheirAwaiter) {
  auto first = make_engine(EngineKind::automatic);
  ASSERT_TRUE(first.is_ok()) << first.status().to_string();
  SecondLoop second;
  ASSERT_NE(second.engine(), nullptr);
  Engine* home = first->get();
  const std::thread::id home_id = std::this_thread::get_id();
  constexpr int kRounds = 2000;
  auto task = [&]() -> Task<int> {
    int matching = 0;
    for (int i = 0; i < kRounds; ++i) {
      std::string got = co_await finish_on(second.engine(), i);
      std::thread::id here = std::this_thread::get_id();
      if (got == "value " + std::to_string(i) && (here == home_id || here == second.id())) ++matching;
      co_await switch_to(home);
    }
    co_return matching;
  };
  EXPECT_EQ(run_sync(*home, task()), kRounds);
}

Task<Status> fail_below(int depth, int err) {
  if (depth == 0) co_return Status::errorf(err, "leaf failed with {}", err);
  QCOWFS_CO_TRY(co_await fail_below(depth - 1, err));
  co_return Status::ok();
}

TEST(Task, StatusTravelsUpThroughNestedAwaits) {
  Status st = Status::ok();
  bool finished = false;
  spawn_then(fail_below(200, ENOSPC), [&](Status s) {
    st = std::move(s);
    finished = true;
  });
  ASSERT_TRUE(finished);
  EXPECT_EQ(st.code(), ENOSPC);
  EXPECT_EQ(st.message(), fmt::format("leaf failed with {}", ENOSPC));
}

Task<Result<std::unique_ptr<int>>> boxed_after_offload(int v, bool fail) {
  int got = co_await after_offload(v);
  if (fail) co_return Status::error(EIO, "asked to fail");
  co_return std::make_unique<int>(got);
}

TEST(Task, MoveOnlyResultsAndErrorsComeBackAfterSuspending) {
  auto engine = make_engine(EngineKind::automatic);
  ASSERT_TRUE(engine.is_ok()) << engine.status().to_string();
  auto ok = run_sync(**engine, boxed_after_offload(41, false));
  ASSERT_TRUE(ok.is_ok()) << ok.status().to_string();
  EXPECT_EQ(**ok, 41);
  auto failed = run_sync(**engine, boxed_after_offload(41, true));
  ASSERT_FALSE(failed.is_ok());
  EXPECT_EQ(failed.status().code(), EIO);
}

Task<void> mark_then_wait(bool* started, AsyncEvent* ev, bool* finished) {
  *started = true;
  co_await ev->wait();
  *finished = true;
}

TEST(Task, SpawnRunsUntilTheFirstSuspensionAndFinishesLater) {
  auto engine = make_engine(EngineKind::automatic);
  ASSERT_TRUE(engine.is_ok()) << engine.status().to_string();
  ScopedEngine scope(engine->get());
  bool started = false, finished = false;
  AsyncEvent ev;
  spawn(mark_then_wait(&started, &ev, &finished));
  EXPECT_TRUE(started);
  EXPECT_FALSE(finished);
  ev.set();  // the waiter is resumed through the engine, not inline
  EXPECT_FALSE(finished);
  for (int i = 0; i < 100 && !finished; ++i) (*engine)->run_once(100);
  EXPECT_TRUE(finished);
}

Task<void> set_flag(bool* flag) {
  *flag = true;
  co_return;
}

TEST(Task, UnawaitedTaskNeverRuns) {
  bool ran = false;
  { Task<void> t = set_flag(&ran); }
  EXPECT_FALSE(ran);
  bool done = false;
  spawn_then(set_flag(&ran), [&] { done = true; });
  EXPECT_TRUE(ran);
  EXPECT_TRUE(done);
}

Task<int> throws_inside() {
  co_await stack_probe();
  throw std::runtime_error("escaped");
}

TEST(TaskDeathTest, ExceptionEscapingATaskTerminates) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(spawn_then(throws_inside(), [](int) {}), "");
}

}  // namespace
}  // namespace qcowfs::io
