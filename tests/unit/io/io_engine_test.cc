// Engine tests, run against both engines: request completion, poll_in,
// post() from other threads, offload, switch_to, timeouts and timers.
#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "io/engine.h"
#include "io/fd.h"
#include "io/run_sync.h"
#include "io/sync.h"
#include "io/task.h"

namespace qcowfs::io {
namespace {

class EngineTest : public ::testing::TestWithParam<EngineKind> {
 protected:
  void SetUp() override {
    auto e = make_engine(GetParam());
    ASSERT_TRUE(e.is_ok()) << e.status().to_string();
    engine_ = std::move(*e);
  }
  std::unique_ptr<Engine> engine_;
};

std::string temp_path(const char* tag) {
  return fmt::format("/var/tmp/qcowfs_io_engine_{}_{}", tag, ::getpid());
}

TEST_P(EngineTest, NameMatchesKind) {
  EXPECT_EQ(engine_->name(), GetParam() == EngineKind::io_uring ? "io_uring" : "threads");
}

TEST_P(EngineTest, WriteThenReadRoundTrip) {
  std::string path = temp_path("rw");
  UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  ASSERT_TRUE(fd.valid());
  ::unlink(path.c_str());
  auto task = [&]() -> Task<std::string> {
    std::string out(5, '\0');
    char msg[] = "hello";
    IoRequest w;
    w.op = IoRequest::Op::write;
    w.fd = fd.get();
    w.buf = msg;
    w.length = 5;
    w.offset = 3;
    int64_t wr = co_await io::async(std::move(w));
    if (wr != 5) co_return "write returned " + std::to_string(wr);
    IoRequest r;
    r.op = IoRequest::Op::read;
    r.fd = fd.get();
    r.buf = out.data();
    r.length = 5;
    r.offset = 3;
    int64_t rd = co_await io::async(std::move(r));
    if (rd != 5) co_return "read returned " + std::to_string(rd);
    co_return out;
  };
  EXPECT_EQ(run_sync(*engine_, task()), "hello");
}

TEST_P(EngineTest, ErrorsComeBackAsNegativeErrno) {
  auto task = []() -> Task<int64_t> {
    char b[8];
    IoRequest r;
    r.op = IoRequest::Op::read;
    r.fd = 1 << 20;  // not an open descriptor
    r.buf = b;
    r.length = sizeof(b);
    co_return co_await io::async(std::move(r));
  };
  EXPECT_EQ(run_sync(*engine_, task()), -EBADF);
}

TEST_P(EngineTest, ManyConcurrentRequestsAllComplete) {
  std::string path = temp_path("many");
  UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  ASSERT_TRUE(fd.valid());
  ::unlink(path.c_str());
  constexpr int kCount = 2000;  // far more than the queue depth
  std::vector<uint32_t> values(kCount);
  int done = 0;
  ScopedEngine scope(engine_.get());
  // Coroutine lambdas take what they use as parameters (copied into the frame):
  // a capturing closure would be gone by the time the coroutine resumes.
  auto one = [](int file, uint32_t* value, uint64_t off, int* finished) -> Task<void> {
    IoRequest w;
    w.op = IoRequest::Op::write;
    w.fd = file;
    w.buf = value;
    w.length = sizeof(uint32_t);
    w.offset = off;
    int64_t r = co_await io::async(std::move(w));
    EXPECT_EQ(r, 4);
    ++*finished;
  };
  for (int i = 0; i < kCount; ++i) {
    values[static_cast<size_t>(i)] = static_cast<uint32_t>(i * 7 + 1);
    spawn(one(fd.get(), &values[static_cast<size_t>(i)], static_cast<uint64_t>(i) * sizeof(uint32_t), &done));
  }
  while (done < kCount) engine_->run_once(-1);
  std::vector<uint32_t> back(kCount);
  ASSERT_EQ(::pread(fd.get(), back.data(), kCount * 4, 0), kCount * 4);
  EXPECT_EQ(back, values);
}

TEST_P(EngineTest, PollInCompletesWhenFdBecomesReadable) {
  UniqueFd efd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  ASSERT_TRUE(efd.valid());
  std::atomic<bool> fired{false};
  int64_t result = 0;
  ScopedEngine scope(engine_.get());
  auto waiter = [&]() -> Task<void> {
    IoRequest p;
    p.op = IoRequest::Op::poll_in;
    p.fd = efd.get();
    result = co_await io::async(std::move(p));
    fired = true;
  };
  spawn(waiter());
  for (int i = 0; i < 3; ++i) engine_->run_once(10);
  EXPECT_FALSE(fired) << "poll_in completed before the fd was readable";
  std::thread writer([&] {
    uint64_t one = 1;
    ASSERT_EQ(::write(efd.get(), &one, sizeof(one)), 8);
  });
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!fired && std::chrono::steady_clock::now() < deadline) engine_->run_once(100);
  writer.join();
  ASSERT_TRUE(fired);
  EXPECT_TRUE(result & POLLIN) << result;
}

// A poll_in whose request can be cancelled: `pending` points at it while it waits.
struct PollWaiter {
  IoRequest* pending = nullptr;
  bool fired = false;
  int64_t result = 0;
};

Task<void> wait_once(IoRequest req, PollWaiter* w) {
  IoAwaiter waiting = io::async(std::move(req));
  w->pending = &waiting.req;
  w->result = co_await waiting;
  w->pending = nullptr;
  w->fired = true;
}

IoRequest poll_request(int fd, bool exclusive) {
  IoRequest p;
  p.op = IoRequest::Op::poll_in;
  p.fd = fd;
  p.poll_exclusive = exclusive;
  return p;
}

// Runs the engine until every waiter fired (or 10 s passed, generous for a loaded machine).
void run_until_fired(Engine& engine, const std::vector<PollWaiter*>& ws) {
  auto all = [&] { return std::all_of(ws.begin(), ws.end(), [](PollWaiter* w) { return w->fired; }); };
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!all() && std::chrono::steady_clock::now() < deadline) engine.run_once(100);
}

// cancel() ends a pending poll and a pending timer with -ECANCELED, also one
// cancelled before the engine ever ran it; the other requests are untouched.
TEST_P(EngineTest, CancelEndsPendingPollsAndTimers) {
  UniqueFd efd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  ASSERT_TRUE(efd.valid());
  ScopedEngine scope(engine_.get());
  Timespec long_wait;
  long_wait.tv_sec = 60;
  IoRequest timer;
  timer.op = IoRequest::Op::timeout;
  timer.buf = &long_wait;
  PollWaiter early, armed, timed, untouched;
  spawn(wait_once(poll_request(efd.get(), false), &early));
  ASSERT_NE(early.pending, nullptr);
  engine_->cancel(early.pending);  // still queued: never reached the kernel or the poll set
  spawn(wait_once(poll_request(efd.get(), false), &armed));
  spawn(wait_once(timer, &timed));
  spawn(wait_once(poll_request(efd.get(), false), &untouched));
  for (int i = 0; i < 3; ++i) engine_->run_once(10);
  EXPECT_TRUE(early.fired);
  EXPECT_FALSE(armed.fired || timed.fired || untouched.fired);
  engine_->cancel(armed.pending);
  engine_->cancel(timed.pending);
  run_until_fired(*engine_, {&armed, &timed});
  EXPECT_EQ(early.result, -ECANCELED);
  EXPECT_EQ(armed.result, -ECANCELED);
  EXPECT_EQ(timed.result, -ECANCELED);
  EXPECT_FALSE(untouched.fired);
  uint64_t one = 1;
  ASSERT_EQ(::write(efd.get(), &one, sizeof one), 8);
  run_until_fired(*engine_, {&untouched});
  EXPECT_TRUE(untouched.result & POLLIN) << untouched.result;
}

// Two pollers of one eventfd and one write: plain pollers both wake, exclusive
// ones (EPOLLEXCLUSIVE) one only, as FUSE's wake-up of a queued request wakes
// one of the loops polling /dev/fuse. Returns how many fired; the one left
// pending is cancelled.
int fired_by_one_write(Engine& engine, bool exclusive) {
  UniqueFd efd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!efd.valid()) return -1;
  ScopedEngine scope(&engine);
  PollWaiter a, b;
  spawn(wait_once(poll_request(efd.get(), exclusive), &a));
  spawn(wait_once(poll_request(efd.get(), exclusive), &b));
  for (int i = 0; i < 3; ++i) engine.run_once(10);
  if (a.fired || b.fired) return -1;
  uint64_t one = 1;
  if (::write(efd.get(), &one, sizeof one) != 8) return -1;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!a.fired && !b.fired && std::chrono::steady_clock::now() < deadline) engine.run_once(100);
  for (int i = 0; i < 3; ++i) engine.run_once(50);  // time for a second wake-up to show
  const int fired = int{a.fired} + int{b.fired};
  for (PollWaiter* w : {&a, &b}) {
    if (w->pending) engine.cancel(w->pending);
  }
  run_until_fired(engine, {&a, &b});
  return a.fired && b.fired ? fired : -1;
}

TEST(UringPollTest, ExclusivePollersWakeOneAtATime) {
  auto e = make_engine(EngineKind::io_uring);
  ASSERT_TRUE(e.is_ok()) << e.status().to_string();
  EXPECT_EQ(fired_by_one_write(**e, false), 2);
  EXPECT_EQ(fired_by_one_write(**e, true), 1);
}

IoRequest read_ready_request(int fd, void* buf, size_t len, bool exclusive) {
  IoRequest r;
  r.op = IoRequest::Op::read_ready;
  r.fd = fd;
  r.buf = buf;
  r.length = len;
  r.poll_exclusive = exclusive;
  return r;
}

// Two read_ready waiters of one non-blocking pipe on an io_uring engine.
class UringReadReady : public ::testing::Test {
 protected:
  void SetUp() override {
    auto e = make_engine(EngineKind::io_uring);
    ASSERT_TRUE(e.is_ok()) << e.status().to_string();
    engine_ = std::move(*e);
    scope_.emplace(engine_.get());
    int fds[2];
    ASSERT_EQ(::pipe2(fds, O_CLOEXEC | O_NONBLOCK), 0);
    rd_ = UniqueFd(fds[0]);
    wr_ = UniqueFd(fds[1]);
  }
  // Arms both waiters; neither may complete before something is written.
  void arm_both(bool exclusive) {
    spawn(wait_once(read_ready_request(rd_.get(), a_, sizeof a_, exclusive), &first_));
    spawn(wait_once(read_ready_request(rd_.get(), b_, sizeof b_, exclusive), &second_));
    for (int i = 0; i < 3; ++i) engine_->run_once(10);
    EXPECT_FALSE(first_.fired || second_.fired) << "read_ready completed before the fd was readable";
  }
  // Writes msg, runs until a waiter fired, then a little longer (time for a
  // second wake-up to show).
  void write_and_settle(const std::string& msg) {
    ASSERT_EQ(::write(wr_.get(), msg.data(), msg.size()), static_cast<ssize_t>(msg.size()));
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!first_.fired && !second_.fired && std::chrono::steady_clock::now() < deadline) engine_->run_once(100);
    for (int i = 0; i < 3; ++i) engine_->run_once(50);
  }
  std::unique_ptr<Engine> engine_;
  std::optional<ScopedEngine> scope_;
  UniqueFd rd_, wr_;
  char a_[8] = {}, b_[8] = {};
  PollWaiter first_, second_;
};

// read_ready waits until the fd is readable, then reads in the kernel. Of two
// plain waiters woken by one message one reads it; the other either finds
// nothing (-EAGAIN, returned rather than retried: /dev/fuse) or, on a file
// io_uring can re-poll by itself (a pipe), reads the next message. A
// cancelled one ends with -ECANCELED and reads nothing.
TEST_F(UringReadReady, ReadsWhenReadableAndLeavesTakenMessages) {
  arm_both(false);
  write_and_settle("hello");
  ASSERT_TRUE(first_.fired || second_.fired);
  const bool a_took = first_.fired && first_.result == 5;
  PollWaiter& other = a_took ? second_ : first_;
  EXPECT_EQ((a_took ? first_ : second_).result, 5);
  EXPECT_EQ(std::string(a_took ? a_ : b_, 5), "hello");
  if (other.fired) {
    EXPECT_EQ(other.result, -EAGAIN);
  } else {
    ASSERT_EQ(::write(wr_.get(), "world", 5), 5);
    run_until_fired(*engine_, {&other});
    EXPECT_EQ(other.result, 5);
    EXPECT_EQ(std::string(a_took ? b_ : a_, 5), "world");
  }

  PollWaiter cancelled;
  spawn(wait_once(read_ready_request(rd_.get(), a_, sizeof a_, true), &cancelled));
  for (int i = 0; i < 3; ++i) engine_->run_once(10);
  ASSERT_FALSE(cancelled.fired);
  engine_->cancel(cancelled.pending);
  run_until_fired(*engine_, {&cancelled});
  EXPECT_EQ(cancelled.result, -ECANCELED);
  ASSERT_EQ(::write(wr_.get(), "x", 1), 1);  // not consumed by the cancelled read
  char c = 0;
  EXPECT_EQ(::read(rd_.get(), &c, 1), 1);
}

// Exclusive read_ready waiters: one message wakes one of them, which reads it.
TEST_F(UringReadReady, ExclusiveWaitersWakeOneAtATime) {
  arm_both(true);
  write_and_settle("abc");
  EXPECT_EQ(int{first_.fired} + int{second_.fired}, 1);
  EXPECT_EQ(first_.fired ? first_.result : second_.result, 3);
  for (PollWaiter* w : {&first_, &second_}) {
    if (w->pending) engine_->cancel(w->pending);
  }
  run_until_fired(*engine_, {&first_, &second_});
}

// Engines that cannot read in the kernel say so.
TEST(ThreadEngineReadReadyTest, IsNotSupported) {
  auto e = make_engine(EngineKind::threads);
  ASSERT_TRUE(e.is_ok()) << e.status().to_string();
  ScopedEngine scope(e->get());
  int fds[2];
  ASSERT_EQ(::pipe2(fds, O_CLOEXEC | O_NONBLOCK), 0);
  UniqueFd rd(fds[0]), wr(fds[1]);
  char a[8] = {};
  PollWaiter w;
  spawn(wait_once(read_ready_request(rd.get(), a, sizeof a, false), &w));
  run_until_fired(**e, {&w});
  EXPECT_EQ(w.result, -EOPNOTSUPP);
  EXPECT_FALSE((*e)->submits_inline());
}

TEST_P(EngineTest, PostFromOtherThreadWakesBlockedLoop) {
  std::atomic<int> ran{0};
  std::thread::id ran_on;
  std::thread poster([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    engine_->post([&] {
      ran_on = std::this_thread::get_id();
      ++ran;
    });
  });
  auto start = std::chrono::steady_clock::now();
  while (ran == 0 && std::chrono::steady_clock::now() - start < std::chrono::seconds(10))
    engine_->run_once(-1);  // must be woken by the post, not by a timeout
  poster.join();
  EXPECT_EQ(ran, 1);
  EXPECT_EQ(ran_on, std::this_thread::get_id());
}

TEST_P(EngineTest, PostsFromManyThreadsAllRunInOrderPerThread) {
  constexpr int kThreads = 4, kPerThread = 500;
  std::vector<std::vector<int>> seen(kThreads);
  std::atomic<int> total{0};
  std::vector<std::thread> posters;
  for (int t = 0; t < kThreads; ++t) {
    posters.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) engine_->post([&, t, i] {
        seen[static_cast<size_t>(t)].push_back(i);
        ++total;
      });
    });
  }
  auto start = std::chrono::steady_clock::now();
  while (total < kThreads * kPerThread && std::chrono::steady_clock::now() - start < std::chrono::seconds(20))
    engine_->run_once(100);
  for (auto& p : posters) p.join();
  ASSERT_EQ(total, kThreads * kPerThread);
  for (auto& s : seen) {
    ASSERT_EQ(s.size(), static_cast<size_t>(kPerThread));
    for (int i = 0; i < kPerThread; ++i) EXPECT_EQ(s[static_cast<size_t>(i)], i);
  }
}

TEST_P(EngineTest, PostFromOwnThreadRunsWithoutBlocking) {
  ScopedEngine scope(engine_.get());
  bool ran = false;
  engine_->post([&] { ran = true; });
  auto start = std::chrono::steady_clock::now();
  engine_->run_once(5000);
  EXPECT_TRUE(ran);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(4));
}

TEST_P(EngineTest, TimeoutReturnsWithoutWork) {
  auto start = std::chrono::steady_clock::now();
  engine_->run_once(30);
  auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_GE(elapsed, std::chrono::milliseconds(20));
}

// sleep_for() resumes no sooner than asked, on the loop's thread, and the loop
// serves other work meanwhile (no thread sleeps): a second coroutine's shorter
// timer and posted functions run first.
TEST_P(EngineTest, SleepForResumesAfterItsTimeWhileTheLoopGoesOn) {
  using namespace std::chrono_literals;
  const auto start = std::chrono::steady_clock::now();
  std::vector<int> order;
  auto sleeper = [&](std::chrono::microseconds d, int tag) -> Task<void> {
    co_await sleep_for(d);
    order.push_back(tag);
  };
  auto both = [&]() -> Task<std::chrono::steady_clock::duration> {
    bool short_done = false;
    spawn_then(sleeper(2000us, 1), [&] { short_done = true; });
    engine_->post([&] { order.push_back(0); });
    co_await sleeper(30000us, 2);
    co_return short_done ? std::chrono::steady_clock::now() - start : std::chrono::steady_clock::duration::zero();
  };
  const auto elapsed = run_sync(*engine_, both());
  EXPECT_GE(elapsed, 30ms);
  EXPECT_LT(elapsed, 5s);
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2}));
  auto zero = []() -> Task<int> {
    co_await sleep_for(std::chrono::nanoseconds(0));
    co_return 7;
  };
  EXPECT_EQ(run_sync(*engine_, zero()), 7);
}

TEST_P(EngineTest, OffloadRunsOnAnotherThreadAndResumesHere) {
  std::thread::id loop_thread = std::this_thread::get_id();
  auto task = [&]() -> Task<std::pair<int64_t, bool>> {
    std::thread::id worker;
    int64_t r = co_await io::offload([&] {
      worker = std::this_thread::get_id();
      return int64_t{42};
    });
    bool resumed_here = std::this_thread::get_id() == loop_thread;
    co_return std::pair{r, worker != loop_thread && resumed_here};
  };
  auto [r, threads_ok] = run_sync(*engine_, task());
  EXPECT_EQ(r, 42);
  EXPECT_TRUE(threads_ok);
}

TEST_P(EngineTest, OffloadErrorIsPassedThrough) {
  auto task = []() -> Task<int64_t> { co_return co_await io::offload([] { return int64_t{-ENOSPC}; }); };
  EXPECT_EQ(run_sync(*engine_, task()), -ENOSPC);
}

TEST_P(EngineTest, FdatasyncAndFallocate) {
  std::string path = temp_path("sync");
  UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  ASSERT_TRUE(fd.valid());
  ::unlink(path.c_str());
  auto task = [&]() -> Task<std::pair<int64_t, int64_t>> {
    IoRequest f;
    f.op = IoRequest::Op::fallocate;
    f.fd = fd.get();
    f.offset = 0;
    f.length = 1 << 20;
    int64_t fr = co_await io::async(std::move(f));
    IoRequest s;
    s.op = IoRequest::Op::fdatasync;
    s.fd = fd.get();
    int64_t sr = co_await io::async(std::move(s));
    co_return std::pair{fr, sr};
  };
  auto [fr, sr] = run_sync(*engine_, task());
  EXPECT_EQ(fr, 0);
  EXPECT_EQ(sr, 0);
  struct stat st;
  ASSERT_EQ(::fstat(fd.get(), &st), 0);
  EXPECT_EQ(st.st_size, 1 << 20);
}

TEST_P(EngineTest, SwitchToMovesCoroutineBetweenLoops) {
  auto other = make_engine(GetParam());
  ASSERT_TRUE(other.is_ok());
  Engine* second = other->get();
  std::atomic<bool> stop{false}, ready{false};
  std::thread::id second_id;
  std::thread loop([&] {
    ScopedEngine scope(second);
    second_id = std::this_thread::get_id();
    ready = true;
    while (!stop) second->run_once(20);
  });
  while (!ready) std::this_thread::yield();
  Engine* first = engine_.get();
  auto task = [&]() -> Task<std::pair<std::thread::id, std::thread::id>> {
    std::thread::id there;
    for (int i = 0; i < 200; ++i) {  // many hops: each must be woken promptly, not by a timeout
      co_await switch_to(second);
      there = std::this_thread::get_id();
      co_await switch_to(first);
    }
    co_return std::pair{there, std::this_thread::get_id()};
  };
  auto [there, back] = run_sync(*first, task());
  stop = true;
  loop.join();
  EXPECT_EQ(there, second_id);
  EXPECT_EQ(back, std::this_thread::get_id());
}

TEST_P(EngineTest, AsyncMutexAcrossThreadsKeepsEachCoroutineOnItsLoop) {
  auto other = make_engine(GetParam());
  ASSERT_TRUE(other.is_ok());
  AsyncMutex mu;
  long counter = 0;
  constexpr int kIters = 300;
  auto worker = [&](Engine* e, std::atomic<bool>* wrong_thread) {
    ScopedEngine scope(e);
    auto me = std::this_thread::get_id();
    int finished = 0;
    auto one = [](AsyncMutex* m, long* count, std::thread::id home, std::atomic<bool>* wrong_home,
                  int* fin) -> Task<void> {
      auto g = co_await m->lock();
      long v = *count;
      co_await io::offload([] { return int64_t{0}; });  // hold the lock across a suspension
      *count = v + 1;
      if (std::this_thread::get_id() != home) *wrong_home = true;
      ++*fin;
    };
    for (int i = 0; i < kIters; ++i) spawn(one(&mu, &counter, me, wrong_thread, &finished));
    while (finished < kIters) e->run_once(50);
  };
  std::atomic<bool> wrong{false};
  std::thread t2(worker, other->get(), &wrong);
  worker(engine_.get(), &wrong);
  t2.join();
  EXPECT_EQ(counter, 2 * kIters);
  EXPECT_FALSE(wrong);
}

TEST(EngineCurrent, AwaitWithoutEngineFailsWithEinval) {
  ASSERT_EQ(Engine::current(), nullptr);
  int64_t result = 1;
  auto task = [&]() -> Task<void> { result = co_await io::offload([] { return int64_t{0}; }); };
  spawn(task());
  EXPECT_EQ(result, -EINVAL);
}

TEST(EngineCurrent, ScopedEngineRestoresPrevious) {
  auto a = make_engine(EngineKind::threads);
  auto b = make_engine(EngineKind::threads);
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  {
    ScopedEngine sa(a->get());
    EXPECT_EQ(Engine::current(), a->get());
    {
      ScopedEngine sb(b->get());
      EXPECT_EQ(Engine::current(), b->get());
    }
    EXPECT_EQ(Engine::current(), a->get());
  }
  EXPECT_EQ(Engine::current(), nullptr);
}

std::string engine_name(const ::testing::TestParamInfo<EngineKind>& p) {
  return p.param == EngineKind::io_uring ? "io_uring" : "threads";
}

// A request with on_done instead of a waiter: the engine calls it on its own
// thread (the FUSE ring's entries are such requests).
TEST_P(EngineTest, OnDoneCallbackRunsInsteadOfAWaiter) {
  std::string path = temp_path("on_done");
  UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  ASSERT_TRUE(fd.valid());
  ::unlink(path.c_str());
  const uint64_t seven = 7;
  ASSERT_EQ(::pwrite(fd.get(), &seven, sizeof seven, 0), static_cast<ssize_t>(sizeof seven));
  struct Probe : IoRequest {
    int calls = 0;
    std::thread::id thread;
  } probe;
  uint64_t value = 0;
  probe.op = IoRequest::Op::read;
  probe.fd = fd.get();
  probe.buf = &value;
  probe.length = sizeof value;
  probe.on_done = [](IoRequest* r) {
    auto* p = static_cast<Probe*>(r);
    ++p->calls;
    p->thread = std::this_thread::get_id();
  };
  ScopedEngine scope(engine_.get());
  engine_->enqueue(&probe);
  for (int i = 0; i < 100 && probe.calls == 0; ++i) engine_->run_once(100);
  EXPECT_EQ(probe.calls, 1);
  EXPECT_EQ(probe.result, static_cast<int64_t>(sizeof value));
  EXPECT_EQ(value, 7u);
  EXPECT_EQ(probe.thread, std::this_thread::get_id());
}

// Op::uring_cmd needs 128-byte SQEs: elsewhere it fails cleanly, never reaching the kernel.
TEST_P(EngineTest, UringCmdWithoutSupportFailsWithEopnotsupp) {
  ASSERT_FALSE(engine_->supports_uring_cmd());  // made without EngineFeatures::uring_cmd
  ScopedEngine scope(engine_.get());
  auto task = [&]() -> Task<int64_t> {
    uint64_t cmd[3] = {};
    IoRequest r;
    r.op = IoRequest::Op::uring_cmd;
    r.fd = 0;
    r.cmd_op = 1;
    r.buf = cmd;
    r.length = sizeof cmd;
    co_return co_await io::async(std::move(r));
  };
  EXPECT_EQ(run_sync(*engine_, task()), -EOPNOTSUPP);
}

// A uring_cmd reaches the driver with its 128-byte SQE: /dev/fuse without a
// mount refuses it with its own error (EINVAL would mean the driver saw no
// SQE128, EOPNOTSUPP that the command never left the engine or that the kernel
// lacks FUSE over io_uring).
TEST(UringCmdTest, CommandReachesTheDriver) {
  EngineFeatures features;
  features.uring_cmd = true;
  auto e = make_engine(EngineKind::io_uring, 64, features);
  ASSERT_TRUE(e.is_ok()) << e.status().to_string();
  ASSERT_TRUE((*e)->supports_uring_cmd());
  UniqueFd fuse(::open("/dev/fuse", O_RDWR | O_CLOEXEC));
  ASSERT_TRUE(fuse.valid()) << "open /dev/fuse: " << std::strerror(errno);
  ScopedEngine scope(e->get());
  auto task = [&]() -> Task<int64_t> {
    uint64_t cmd[3] = {};
    IoRequest r;
    r.op = IoRequest::Op::uring_cmd;
    r.fd = fuse.get();
    r.cmd_op = 1;
    r.buf = cmd;
    r.length = sizeof cmd;
    co_return co_await io::async(std::move(r));
  };
  const int64_t r = run_sync(**e, task());
  EXPECT_LT(r, 0);
  EXPECT_NE(r, -EINVAL);
  EXPECT_NE(r, -EOPNOTSUPP);
}

INSTANTIATE_TEST_SUITE_P(Engines, EngineTest, ::testing::Values(EngineKind::io_uring, EngineKind::threads),
                         engine_name);

}  // namespace
}  // namespace qcowfs::io
