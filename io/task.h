// Task<T>: a lazily started C++20 coroutine returning T, awaited with co_await.
// Every request in qcowfs is a Task: it runs on an event-loop thread, suspends
// while host I/O is in flight and resumes on the thread whose Engine completed
// that I/O. spawn() starts a Task detached; run_sync() drives one to completion
// on a private loop (used at open time and in tests).
//
// How an awaited Task hands control back (detail::Handoff): `co_await task`
// starts the task with resume() inside await_suspend. If the task finishes
// before that resume() returns (it never suspended, e.g. cache hits or an
// in-memory file), await_suspend returns false and the awaiter continues on
// the same, unwound stack; if it suspended, the awaiter suspends too and the
// task's final_suspend transfers straight to it when the task finishes, on
// whatever thread that is. So stack depth follows the nesting of coroutines,
// never the number of awaits one after another, even in builds where the
// compiler cannot make symmetric transfer a tail call (sanitizers, -O0).
//
// Thread-safety: a Task object is owned by one awaiter and awaited once; it is
// not shared. A task may finish on another thread than the one that awaited it
// (it moved with io::switch_to); the handoff is one atomic, so the awaiter sees
// everything the task wrote. The awaiter then goes on on the task's thread if
// it had already suspended, else on its own: code that must run on a given
// loop after such an await switches there itself.
// No exceptions cross a Task: an escaping exception terminates the process.
#pragma once

#include <atomic>
#include <coroutine>
#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <utility>

#include "io/frame_pool.h"

namespace qcowfs {

template <typename T>
class Task;

namespace detail {

// Who gets to the end of an await first: the awaiting coroutine (suspending in
// await_suspend) or the awaited task (finishing in final_suspend). Transitions:
//   running -> done                     the task finished before the awaiter
//                                       suspended: the awaiter goes on by itself.
//   running -> awaiter_suspended        the task suspended inside resume();
//   awaiter_suspended -> done           later it finishes and resumes the awaiter.
enum class Handoff : uint8_t { running, awaiter_suspended, done };

struct PromiseBase {
  // Frames come from the thread's FramePool (io/frame_pool.h).
  static void* operator new(std::size_t n) { return FramePool::allocate(n); }
  static void operator delete(void* p, std::size_t n) noexcept { FramePool::deallocate(p, n); }

  std::coroutine_handle<> continuation;  // the awaiting coroutine
  std::atomic<Handoff> handoff{Handoff::running};

  std::suspend_always initial_suspend() noexcept { return {}; }
  struct FinalAwaiter {
    bool await_ready() noexcept { return false; }
    // acq_rel: release publishes the result to an awaiter that reads it after
    // seeing `done`; acquire pairs with the awaiter's release when it suspended,
    // so the awaiter resumed here sees its own earlier writes. When the awaiter
    // has not suspended it may destroy this frame as soon as it sees `done`, so
    // nothing after the exchange touches the frame.
    template <typename P>
    std::coroutine_handle<> await_suspend(std::coroutine_handle<P> h) noexcept {
      PromiseBase& p = h.promise();
      if (p.handoff.exchange(Handoff::done, std::memory_order_acq_rel) == Handoff::awaiter_suspended) {
        return p.continuation;
      }
      return std::noop_coroutine();
    }
    void await_resume() noexcept {}
  };
  FinalAwaiter final_suspend() noexcept { return {}; }
  void unhandled_exception() noexcept { std::terminate(); }

  // Runs the task from the awaiter's await_suspend; returns whether the awaiter
  // must suspend (false: the task has finished and its result can be taken).
  // The load keeps the common, synchronous case to the one exchange in
  // final_suspend. Once the compare-exchange succeeds the task may finish on
  // another thread and resume the awaiter at once, so nothing after it touches
  // either frame.
  bool start_and_suspend_unless_done(std::coroutine_handle<> self, std::coroutine_handle<> awaiting) noexcept {
    continuation = awaiting;
    self.resume();
    if (handoff.load(std::memory_order_acquire) == Handoff::done) return false;
    Handoff expected = Handoff::running;
    return handoff.compare_exchange_strong(expected, Handoff::awaiter_suspended, std::memory_order_acq_rel,
                                           std::memory_order_acquire);
  }
};

template <typename T>
struct Promise : PromiseBase {
  std::optional<T> value;
  Task<T> get_return_object() noexcept;
  template <typename U>
  void return_value(U&& v) { value.emplace(std::forward<U>(v)); }
  T take() { return std::move(*value); }
};

template <>
struct Promise<void> : PromiseBase {
  Task<void> get_return_object() noexcept;
  void return_void() noexcept {}
  void take() noexcept {}
};

}  // namespace detail

template <typename T = void>
class [[nodiscard]] Task {
 public:
  using promise_type = detail::Promise<T>;
  using Handle = std::coroutine_handle<promise_type>;

  Task() = default;
  explicit Task(Handle h) : handle_(h) {}
  Task(Task&& o) noexcept : handle_(std::exchange(o.handle_, {})) {}
  Task& operator=(Task&& o) noexcept {
    if (this != &o) {
      reset();
      handle_ = std::exchange(o.handle_, {});
    }
    return *this;
  }
  Task(const Task&) = delete;
  Task& operator=(const Task&) = delete;
  ~Task() { reset(); }

  bool valid() const { return static_cast<bool>(handle_); }

  auto operator co_await() && noexcept {
    struct Awaiter {
      Handle h;
      bool await_ready() const noexcept { return false; }
      bool await_suspend(std::coroutine_handle<> awaiting) noexcept {
        return h.promise().start_and_suspend_unless_done(h, awaiting);
      }
      T await_resume() { return h.promise().take(); }
    };
    return Awaiter{handle_};
  }

 private:
  void reset() {
    if (handle_) handle_.destroy();
    handle_ = {};
  }
  Handle handle_;
};

namespace detail {
template <typename T>
Task<T> Promise<T>::get_return_object() noexcept {
  return Task<T>(std::coroutine_handle<Promise<T>>::from_promise(*this));
}
inline Task<void> Promise<void>::get_return_object() noexcept {
  return Task<void>(std::coroutine_handle<Promise<void>>::from_promise(*this));
}

// A fire-and-forget coroutine: starts at once and frees itself when done.
struct Detached {
  struct promise_type {
    static void* operator new(std::size_t n) { return FramePool::allocate(n); }
    static void operator delete(void* p, std::size_t n) noexcept { FramePool::deallocate(p, n); }
    Detached get_return_object() noexcept { return {}; }
    std::suspend_never initial_suspend() noexcept { return {}; }
    std::suspend_never final_suspend() noexcept { return {}; }
    void return_void() noexcept {}
    void unhandled_exception() noexcept { std::terminate(); }
  };
};

inline Detached run_detached(Task<void> t) { co_await std::move(t); }

template <typename T, typename F>
Detached run_detached_then(Task<T> t, F done) {
  if constexpr (std::is_void_v<T>) {
    co_await std::move(t);
    done();
  } else {
    done(co_await std::move(t));
  }
}
}  // namespace detail

// Starts t on the calling thread now; it runs until its first suspension.
inline void spawn(Task<void> t) { detail::run_detached(std::move(t)); }

// Starts t now and calls done(result) (done() for Task<void>) when it finishes.
template <typename T, typename F>
void spawn_then(Task<T> t, F done) {
  detail::run_detached_then(std::move(t), std::move(done));
}

}  // namespace qcowfs
