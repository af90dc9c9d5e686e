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

std::shared_ptr<AsyncEvent> RangeLock::try_register(uint64_t start, uint64_t end, Mode mode, uint64_t* id) {
  std::lock_guard lk(mu_);
  // Only an exclusive holder conflicts with a shared request: with none held
  // (every reader and overwrite at once), a shared one registers unscanned.
  const bool can_conflict = mode == Mode::exclusive || exclusive_held_ > 0;
  for (Holder& h : can_conflict ? std::span<Holder>(holders_) : std::span<Holder>()) {
    bool overlap = start < h.end && h.start < end;
    if (overlap && (mode == Mode::exclusive || h.mode == Mode::exclusive)) {
      if (!h.released) h.released = std::make_shared<AsyncEvent>();
      return h.released;
    }
  }
  *id = next_id_++;
  holders_.push_back(Holder{*id, start, end, mode, nullptr});
  if (mode == Mode::exclusive) ++exclusive_held_;
  return nullptr;
}

void RangeLock::unlock(uint64_t id) {
  std::shared_ptr<AsyncEvent> released;
  {
    std::lock_guard lk(mu_);
    for (size_t i = 0; i < holders_.size(); ++i) {
      if (holders_[i].id != id) continue;
      released = std::move(holders_[i].released);
      if (holders_[i].mode == Mode::exclusive) --exclusive_held_;
      holders_[i] = std::move(holders_.back());
      holders_.pop_back();
      break;
    }
  }
  if (released) released->set();
}

size_t RangeLock::held() {
  std::lock_guard lk(mu_);
  return holders_.size();
}

}  // namespace qcowfs::io
