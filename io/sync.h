// Synchronisation that works across event-loop threads.
// AsyncMutex: a FIFO mutex a coroutine may hold across co_await. AsyncEvent: a
// one-shot latch (e.g. "this L2 slice has finished loading"). Waiters are always
// resumed on their own thread's Engine (through post()), never on the thread
// that released them, so a coroutine never migrates between threads.
// AdaptiveMutex: a thread mutex for a few dozen instructions, never held
// across co_await or I/O.
// Thread-safety: all methods are thread-safe. Never block a thread on the
// async ones.
#pragma once

#include <pthread.h>

#include <atomic>
#include <coroutine>
#include <deque>
#include <mutex>
#include <utility>
#include <vector>

#include "io/engine.h"

namespace qcowfs::io {

// A mutex (std::mutex's interface, for std::lock_guard) guarding a critical
// section of a few dozen instructions that event-loop threads share: glibc's
// adaptive mutex, which spins a short while before it sleeps in the kernel,
// so two loops that meet on it rarely pay a futex wait and wake (two
// syscalls and a context switch; a syscall alone costs ~1 us on the machines
// we measure: bench/RESULTS.md).
class AdaptiveMutex {
 public:
  AdaptiveMutex() = default;
  ~AdaptiveMutex() { pthread_mutex_destroy(&m_); }
  AdaptiveMutex(const AdaptiveMutex&) = delete;
  AdaptiveMutex& operator=(const AdaptiveMutex&) = delete;
  void lock() { pthread_mutex_lock(&m_); }
  bool try_lock() { return pthread_mutex_trylock(&m_) == 0; }
  void unlock() { pthread_mutex_unlock(&m_); }

 private:
  pthread_mutex_t m_ = PTHREAD_ADAPTIVE_MUTEX_INITIALIZER_NP;
};

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
  // No mutex round: checked on every cached L2 lookup.
  bool is_set() const { return set_.load(std::memory_order_acquire); }
  void set() {
    std::vector<Waiter> ws;
    {
      std::lock_guard lk(mu_);
      set_.store(true, std::memory_order_release);
      ws.swap(waiters_);
    }
    for (auto& w : ws) w.wake();
  }

 private:
  std::mutex mu_;
  std::atomic<bool> set_{false};  // written under mu_
  std::vector<Waiter> waiters_;
};

}  // namespace qcowfs::io
