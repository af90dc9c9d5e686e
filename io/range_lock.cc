#include "io/range_lock.h"

#include <span>

namespace qcowfs::io {

RangeLock::Guard RangeLock::try_lock(uint64_t start, uint64_t end, Mode mode) {
  uint64_t id = 0;
  if (try_register(start, end, mode, &id)) return Guard();
  return Guard(this, id);
}

Task<RangeLock::Guard> RangeLock::lock_slow(uint64_t start, uint64_t end, Mode mode) {
  uint64_t id = 0;
  while (auto busy = try_register(start, end, mode, &id)) co_await busy->wait();
  co_return Guard(this, id);
}

std::shared_ptr<AsyncEvent> RangeLock::try_register(uint64_t start, uint64_t end, Mode mode, uint64_t* slot) {
  std::lock_guard lk(mu_);
  // Only an exclusive holder conflicts with a shared request: with none held
  // (every reader and overwrite at once), a shared one registers unscanned.
  const bool can_conflict = mode == Mode::exclusive || exclusive_held_ > 0;
  if (can_conflict) {
    for (Holder& h : slots_) {
      bool overlap = start < h.end && h.start < end;  // never for a free slot
      if (overlap && (mode == Mode::exclusive || h.mode == Mode::exclusive)) {
        if (!h.released) h.released = std::make_shared<AsyncEvent>();
        return h.released;
      }
    }
  }
  if (free_.empty()) {
    *slot = slots_.size();
    slots_.emplace_back();
  } else {
    *slot = free_.back();
    free_.pop_back();
  }
  Holder& h = slots_[*slot];
  h.start = start;
  h.end = end;
  h.mode = mode;
  if (mode == Mode::exclusive) ++exclusive_held_;
  return nullptr;
}

void RangeLock::unlock(uint64_t slot) {
  std::shared_ptr<AsyncEvent> released;
  {
    std::lock_guard lk(mu_);
    Holder& h = slots_[slot];
    released = std::move(h.released);
    if (h.mode == Mode::exclusive) --exclusive_held_;
    h.start = UINT64_MAX;  // free: overlaps nothing
    h.end = 0;
    free_.push_back(static_cast<uint32_t>(slot));
  }
  if (released) released->set();
}

size_t RangeLock::held() {
  std::lock_guard lk(mu_);
  return slots_.size() - free_.size();
}

}  // namespace qcowfs::io
