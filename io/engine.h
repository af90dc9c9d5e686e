// Engine: the per-thread asynchronous host I/O engine and event loop.
// Each event-loop thread owns exactly one Engine (Engine::current()). Coroutines
// queue IoRequests on it with co_await; queued requests are submitted together
// (io_uring: one io_uring_enter per loop iteration) and the awaiting coroutine
// is resumed on the same thread when its request completes.
//
// Engines: UringEngine (io_uring) and ThreadEngine (a worker pool, for hosts where
// io_uring is disabled or filtered). make_engine() picks one.
//
// Thread-safety: everything except post() must be called on the owning thread:
// the one thread that drives the engine (enqueue, run_once) for its whole life.
// A UringEngine becomes bound to the first thread that runs it (single-issuer
// ring), so an engine is not handed from one thread to another. post() may be
// called from any thread.
#pragma once

#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <coroutine>
#include <cstdint>
#include <functional>
#include <memory>
#include <string_view>

#include "io/status.h"

namespace qcowfs::io {

struct IoRequest {
  enum class Op : uint8_t {
    read,       // pread(fd, buf, len, offset)
    write,      // pwrite(fd, buf, len, offset)
    readv,      // preadv(fd, iov, iovcnt, offset)
    writev,     // pwritev(fd, iov, iovcnt, offset)
    fsync,      // fsync(fd)
    fdatasync,  // fdatasync(fd)
    fallocate,  // fallocate(fd, mode, offset, length)
    poll_in,    // wait until fd is readable (one-shot); see poll_exclusive
    call,       // run `call` on a worker thread (blocking syscalls, CPU work)
    uring_cmd,  // IORING_OP_URING_CMD on fd: cmd_op, the command bytes in buf/length
                // (at most kUringCmdBytes), iov/iovcnt as the SQE's addr/len;
                // only on engines with supports_uring_cmd()
    timeout,    // completes (result 0) once the Timespec at buf has passed, a
                // timer on the engine: no thread waits (sleep_for())
    read_ready,  // poll_in (poll_exclusive as there), then at once read(fd, buf,
                 // length) in the kernel, without waking this thread in between;
                 // fd must be O_NONBLOCK. If another reader took the data:
                 // -EAGAIN, returned, not retried (/dev/fuse), or, on a file
                 // io_uring re-polls itself (a pipe), the read waits for more.
                 // Only on engines with submits_inline() (io_uring: a linked
                 // POLL_ADD and READ); others: -EOPNOTSUPP
  };
  Op op = Op::read;
  int fd = -1;
  uint64_t offset = 0;
  uint64_t length = 0;  // read/write byte count, fallocate length
  void* buf = nullptr;
  const struct iovec* iov = nullptr;
  unsigned iovcnt = 0;
  int mode = 0;  // fallocate mode
  uint32_t cmd_op = 0;  // uring_cmd: the driver's command code
  // poll_in: wait as an exclusive waiter (EPOLLEXCLUSIVE): a wake-up of fd's
  // waiters that wakes one (a FUSE request, an eventfd write) wakes only one
  // of the exclusive pollers, where a plain poll wakes them all. io_uring
  // only; other engines poll as usual (every poller wakes).
  bool poll_exclusive = false;
  std::function<int64_t()> call;  // Op::call: returns >= 0 or -errno

  int64_t result = 0;  // >= 0 on success (bytes for read/write), -errno on failure
  std::coroutine_handle<> waiter;  // resumed on the engine thread on completion
  // Instead of a waiter: called on the engine thread on completion (for
  // long-lived requests owned by an object rather than a coroutine frame).
  void (*on_done)(IoRequest*) = nullptr;

  void finish() {
    if (on_done) {
      on_done(this);
    } else {
      waiter.resume();
    }
  }
};

// Op::timeout's duration; the layout of the kernel's __kernel_timespec.
struct Timespec {
  int64_t tv_sec = 0;
  long long tv_nsec = 0;
};

// Size of the command area of a 128-byte SQE (IORING_SETUP_SQE128).
constexpr size_t kUringCmdBytes = 80;

enum class EngineKind { automatic, io_uring, threads };

struct EngineFeatures {
  // Ask for 128-byte SQEs so Op::uring_cmd can carry a driver command (FUSE
  // over io_uring). An engine that cannot have them still works without.
  bool uring_cmd = false;
};

class Engine {
 public:
  virtual ~Engine() = default;
  Engine() = default;
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues req; it is submitted at the next run_once(). req must stay alive
  // until its waiter is resumed.
  virtual void enqueue(IoRequest* req) = 0;
  // Submits everything queued (one syscall where the engine allows), waits up
  // to timeout_ms (-1: forever, 0: poll) for completions or posted work, then
  // resumes completed requests' waiters and runs posted functions.
  virtual void run_once(int timeout_ms) = 0;
  // Runs fn on this engine's thread soon. Thread-safe; wakes run_once().
  virtual void post(std::function<void()> fn) = 0;
  // Ends req early: it completes with -ECANCELED in a later run_once(). req
  // must be one enqueued on this engine whose waiter has not been resumed yet;
  // if it completed meanwhile (its result is waiting to be delivered) it keeps
  // its result. Works for poll_in and timeout requests on every engine (on
  // io_uring for any request the kernel can cancel).
  virtual void cancel(IoRequest* req) = 0;
  virtual std::string_view name() const = 0;
  // Whether Op::uring_cmd works (an io_uring engine made with uring_cmd).
  virtual bool supports_uring_cmd() const { return false; }
  // Whether run_once()'s one syscall issues what was enqueued, on this thread
  // (io_uring), rather than a worker thread: then a short write that would be
  // a syscall of its own costs less enqueued.
  virtual bool submits_inline() const { return false; }

  // The engine of the calling thread (nullptr when none is installed).
  static Engine* current();
  // Installs e as the calling thread's engine; returns the previous one.
  static Engine* set_current(Engine* e);
};

// Makes an engine for the calling thread. automatic: io_uring, else threads
// (with a one-line warning saying why io_uring is unavailable).
Result<std::unique_ptr<Engine>> make_engine(EngineKind kind, unsigned queue_depth = 256,
                                            EngineFeatures features = {});

// Awaitable owning one request, queued on the calling thread's engine.
//   int64_t r = co_await io::async(IoRequest{...});   // bytes, or -errno
// The awaiter (and so the request) lives in the coroutine frame while suspended.
struct IoAwaiter {
  IoRequest req;
  bool await_ready() const noexcept { return false; }
  // Without an engine on this thread the request fails at once with -EINVAL
  // (HostFile implementations turn that into "no engine on this thread").
  bool await_suspend(std::coroutine_handle<> h) {
    Engine* engine = Engine::current();
    if (!engine) {
      req.result = -EINVAL;
      return false;
    }
    req.waiter = h;
    engine->enqueue(&req);
    return true;
  }
  int64_t await_resume() const noexcept { return req.result; }
};
inline IoAwaiter async(IoRequest req) { return IoAwaiter{std::move(req)}; }

// Runs fn (blocking syscalls or CPU-heavy work such as decompression) on a
// worker thread and resumes the caller on its own engine thread.
//   int64_t r = co_await io::offload([&] { return blocking_work(); });  // >= 0 or -errno
template <typename F>
IoAwaiter offload(F fn) {
  IoRequest req;
  req.op = IoRequest::Op::call;
  req.call = std::move(fn);
  return IoAwaiter{std::move(req)};
}

// Awaitable timer: resumes the caller on its engine after about `d` (no
// sooner), while the engine goes on with other work.
//   co_await io::sleep_for(std::chrono::microseconds(50));
// Not movable once made: the request points at the awaiter's own duration.
class SleepAwaiter {
 public:
  explicit SleepAwaiter(std::chrono::nanoseconds d) {
    const int64_t ns = std::max<int64_t>(0, d.count());
    ts_.tv_sec = ns / 1000000000;
    ts_.tv_nsec = ns % 1000000000;
    inner_.req.op = IoRequest::Op::timeout;
  }
  SleepAwaiter(const SleepAwaiter&) = delete;
  SleepAwaiter& operator=(const SleepAwaiter&) = delete;
  bool await_ready() const noexcept { return false; }
  bool await_suspend(std::coroutine_handle<> h) {
    inner_.req.buf = &ts_;
    return inner_.await_suspend(h);
  }
  void await_resume() const noexcept {}

 private:
  Timespec ts_;
  IoAwaiter inner_;
};
inline SleepAwaiter sleep_for(std::chrono::nanoseconds d) { return SleepAwaiter(d); }

// Resumes the calling coroutine on engine `target` (via post()): moves a
// coroutine to another event-loop thread.
struct SwitchToAwaiter {
  Engine* target;
  bool await_ready() const noexcept { return target == Engine::current(); }
  void await_suspend(std::coroutine_handle<> h) { target->post([h] { h.resume(); }); }
  void await_resume() const noexcept {}
};
inline SwitchToAwaiter switch_to(Engine* target) { return SwitchToAwaiter{target}; }

// Installs `engine` as current for the scope of the object.
class ScopedEngine {
 public:
  explicit ScopedEngine(Engine* e) : prev_(Engine::set_current(e)) {}
  ~ScopedEngine() { Engine::set_current(prev_); }
  ScopedEngine(const ScopedEngine&) = delete;
  ScopedEngine& operator=(const ScopedEngine&) = delete;

 private:
  Engine* prev_;
};

}  // namespace qcowfs::io
