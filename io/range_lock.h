// RangeLock: byte-range locks held by coroutines across host I/O. PosixFile
// uses it on O_DIRECT files so that a read-modify-write of a partial host block
// never races with another write to the same block: RMW writes, discards,
// write-zeroes and truncates lock their block-aligned range exclusively;
// aligned writes lock theirs shared (they may overlap each other, but not an
// exclusive holder). Waiting suspends the coroutine (never the thread) until a
// conflicting holder releases, then re-checks.
//
// Thread-safety: lock() and release may happen on any event-loop thread; a
// waiter resumes on its own thread's Engine. Holders are few (one per write in
// flight), so a flat list is scanned. The uncontended lock costs one mutex
// round and no allocation: it is taken in the awaiter's await_ready (no
// coroutine frame), and a holder's release event is made only when a
// conflicting request first waits for it.
#pragma once

#include <cstdint>
#include <coroutine>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "io/hold.h"
#include "io/sync.h"
#include "io/task.h"

namespace qcowfs::io {

class RangeLock {
 public:
  enum class Mode { shared, exclusive };

  class [[nodiscard]] Guard {
   public:
    Guard() = default;
    Guard(RangeLock* owner, uint64_t id) : owner_(owner), id_(id) {}
    Guard(Guard&& o) noexcept : owner_(std::exchange(o.owner_, nullptr)), id_(o.id_) {}
    Guard& operator=(Guard&& o) noexcept {
      if (this != &o) {
        release();
        owner_ = std::exchange(o.owner_, nullptr);
        id_ = o.id_;
      }
      return *this;
    }
    Guard(const Guard&) = delete;
    Guard& operator=(const Guard&) = delete;
    ~Guard() { release(); }
    void release() {
      if (owner_) std::exchange(owner_, nullptr)->unlock(id_);
    }
    bool owns() const { return owner_ != nullptr; }
    // The same hold as an io::Hold (for a layer that releases it without
    // knowing it is a range lock's); this guard is left empty.
    Hold into_hold() && {
      RangeLock* owner = std::exchange(owner_, nullptr);
      return owner ? Hold(&RangeLock::unlock_held, owner, id_) : Hold();
    }

   private:
    RangeLock* owner_ = nullptr;
    uint64_t id_ = 0;
  };

  // The awaitable of lock(): takes the range at once when nothing conflicts,
  // else runs the waiting loop (lock_slow) as a task.
  class [[nodiscard]] LockOp {
   public:
    LockOp(RangeLock& owner, uint64_t start, uint64_t end, Mode mode)
        : owner_(owner), start_(start), end_(end), mode_(mode) {}
    bool await_ready() {
      guard_ = owner_.try_lock(start_, end_, mode_);
      return guard_.owns();
    }
    bool await_suspend(std::coroutine_handle<> h) {
      slow_ = owner_.lock_slow(start_, end_, mode_);
      slow_awaiter_.emplace(std::move(slow_).operator co_await());
      return slow_awaiter_->await_suspend(h);
    }
    Guard await_resume() { return slow_awaiter_ ? slow_awaiter_->await_resume() : std::move(guard_); }

   private:
    using SlowAwaiter = decltype(std::declval<Task<Guard>>().operator co_await());
    RangeLock& owner_;
    uint64_t start_, end_;
    Mode mode_;
    Guard guard_;
    Task<Guard> slow_;
    std::optional<SlowAwaiter> slow_awaiter_;
  };

  // Locks [start, end) in mode once no conflicting holder remains
  // (co_await it: the result is the Guard).
  LockOp lock(uint64_t start, uint64_t end, Mode mode) { return LockOp(*this, start, end, mode); }
  // Locks [start, end) in mode when no holder conflicts; else an empty Guard.
  Guard try_lock(uint64_t start, uint64_t end, Mode mode);
  // Number of ranges currently held (for tests).
  size_t held();

 private:
  struct Holder {
    uint64_t start = UINT64_MAX, end = 0;  // a free slot: overlaps nothing
    Mode mode = Mode::shared;
    std::shared_ptr<AsyncEvent> released;  // made by the first request that waits for this holder
  };
  Task<Guard> lock_slow(uint64_t start, uint64_t end, Mode mode);
  // Returns the release event of a conflicting holder, or registers the range
  // (writing its slot) and returns nullptr.
  std::shared_ptr<AsyncEvent> try_register(uint64_t start, uint64_t end, Mode mode, uint64_t* slot);
  void unlock(uint64_t slot);
  static void unlock_held(void* lock, uint64_t slot) { static_cast<RangeLock*>(lock)->unlock(slot); }

  AdaptiveMutex mu_;  // guards everything below
  std::vector<Holder> slots_;   // held ranges and free slots
  std::vector<uint32_t> free_;  // indices of slots_'s free slots
  size_t exclusive_held_ = 0;  // holders in Mode::exclusive: with none, a shared lock scans nothing
};

}  // namespace qcowfs::io
