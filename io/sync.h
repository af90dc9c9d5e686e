// Coroutine synchronisation that works across event-loop threads.
// AsyncMutex: a FIFO mutex a coroutine may hold across co_await. AsyncEvent: a
// one-shot latch (e.g. "this L2 slice has finished loading"). Waiters are always
// resumed on their own thread's Engine (through post()), never on the thread
// that released them, so a coroutine never migrates between threads.
// Thread-safety: all methods are thread-safe. Never block a thread on these.
#pragma once

#include <coroutine>
#include <deque>
#include <mutex>
#include <utility>
#include <vector>

#include "io/engine.h"

namespace qcowfs::io {

struct Waiter {
  std::coroutine_handle<> handle;
  Engine* engine;
  void wake() const {
    auto h = handle;
    engine->post([h] { h.resume(); });
  }
};

class AsyncMutex {
 public:
  class [[nodiscard]] Guard {
   public:
    explicit Guard(AsyncMutex* m) : m_(m) {}
    Guard(Guard&& o) noexcept : m_(std::exchange(o.m_, nullptr)) {}
    Guard& operator=(Guard&& o) noexcept {
      if (this != &o) {
        release();
        m_ = std::exchange(o.m_, nullptr);
      }
      return *this;
    }
    ~Guard() { release(); }
    void release() {
      if (m_) std::exchange(m_, nullptr)->unlock();
    }

   private:
    AsyncMutex* m_;
  };

  struct LockAwaiter {
    AsyncMutex& m;
    bool await_ready() const noexcept { return false; }
    bool await_suspend(std::coroutine_handle<> h) {
      std::lock_guard lk(m.mu_);
      if (!m.locked_) {
        m.locked_ = true;
        return false;  // got it, do not suspend
      }
      m.waiters_.push_back(Waiter{h, Engine::current()});
      return true;
    }
    Guard await_resume() const noexcept { return Guard(&m); }
  };

  // auto guard = co_await mutex.lock();
  LockAwaiter lock() { return LockAwaiter{*this}; }
  // Non-suspending attempt; returns true when the lock was taken (call unlock()).
  bool try_lock() {
    std::lock_guard lk(mu_);
    if (locked_) return false;
    locked_ = true;
    return true;
  }
  void unlock() {
    Waiter next;
    {
      std::lock_guard lk(mu_);
      if (waiters_.empty()) {
        locked_ = false;
        return;
      }
      next = waiters_.front();  // ownership passes straight to the next waiter
      waiters_.pop_front();
    }
    next.wake();
  }

 private:
  std::mutex mu_;
  bool locked_ = false;
  std::deque<Waiter> waiters_;
};

class AsyncEvent {
 public:
  struct WaitAwaiter {
    AsyncEvent& ev;
    bool await_ready() const noexcept { return false; }
    bool await_suspend(std::coroutine_handle<> h) {
      std::lock_guard lk(ev.mu_);
      if (ev.set_) return false;
      ev.waiters_.push_back(Waiter{h, Engine::current()});
      return true;
    }
    void await_resume() const noexcept {}
  };
  WaitAwaiter wait() { return WaitAwaiter{*this}; }
  bool is_set() {
    std::lock_guard lk(mu_);
    return set_;
  }
  void set() {
    std::vector<Waiter> ws;
    {
      std::lock_guard lk(mu_);
      set_ = true;
      ws.swap(waiters_);
    }
    for (auto& w : ws) w.wake();
  }

 private:
  std::mutex mu_;
  bool set_ = false;
  std::vector<Waiter> waiters_;
};

}  // namespace qcowfs::io
