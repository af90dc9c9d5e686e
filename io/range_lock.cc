#include "io/range_lock.h"

namespace qcowfs::io {

Task<RangeLock::Guard> RangeLock::lock(uint64_t start, uint64_t end, Mode mode) {
  uint64_t id = 0;
  while (auto busy = try_register(start, end, mode, &id)) co_await busy->wait();
  co_return Guard(this, id);
}

std::shared_ptr<AsyncEvent> RangeLock::try_register(uint64_t start, uint64_t end, Mode mode, uint64_t* id) {
  std::lock_guard lk(mu_);
  for (const Holder& h : holders_) {
    bool overlap = start < h.end && h.start < end;
    if (overlap && (mode == Mode::exclusive || h.mode == Mode::exclusive)) return h.released;
  }
  *id = next_id_++;
  holders_.push_back(Holder{*id, start, end, mode, std::make_shared<AsyncEvent>()});
  return nullptr;
}

void RangeLock::unlock(uint64_t id) {
  std::shared_ptr<AsyncEvent> released;
  {
    std::lock_guard lk(mu_);
    for (size_t i = 0; i < holders_.size(); ++i) {
      if (holders_[i].id != id) continue;
      released = std::move(holders_[i].released);
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
