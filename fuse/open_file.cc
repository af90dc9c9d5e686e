#include "fuse/open_file.h"

#include <algorithm>
#include <iterator>

namespace qcowfs::fuse {

bool OpenFile::truncating() const {
  std::lock_guard lk(mu_);
  return truncating_;
}

void OpenFile::truncate_to_zero() {
  std::lock_guard lk(mu_);
  truncating_ = true;
  written_.clear();
  size_ = 0;
  overflowed_ = false;
  recording_.store(true, std::memory_order_release);
}

void OpenFile::set_size(uint64_t size) {
  std::lock_guard lk(mu_);
  if (truncating_) size_ = size;
}

// The unlocked check orders as taking the mutex first would: a write noted
// before a concurrent ftruncate(fd, 0) may be missed, which the truncation
// would have cleared anyway; one that follows it reads true.
void OpenFile::note_written(uint64_t off, uint64_t len) {
  if (len == 0 || !recording_.load(std::memory_order_acquire)) return;
  uint64_t end = off + len;  // inside the disk: no overflow
  std::lock_guard lk(mu_);
  if (!truncating_ || overflowed_) return;
  // Merge with every range that overlaps or touches [off, end).
  auto it = written_.upper_bound(off);
  if (it != written_.begin()) {
    auto prev = std::prev(it);
    if (prev->second >= off) it = prev;
  }
  while (it != written_.end() && it->first <= end) {
    off = std::min(off, it->first);
    end = std::max(end, it->second);
    it = written_.erase(it);
  }
  written_.emplace(off, end);
  if (written_.size() > kMaxTrackedRanges) {
    overflowed_ = true;
    recording_.store(false, std::memory_order_release);
    written_.clear();
  }
}

std::vector<OpenFile::Range> OpenFile::take_gaps() {
  std::vector<Range> gaps;
  std::lock_guard lk(mu_);
  if (!truncating_ || overflowed_) return gaps;
  uint64_t at = 0;
  for (const auto& [start, end] : written_) {
    if (start > at) gaps.push_back(Range{at, start - at});
    at = end;
  }
  if (size_ > at) {
    gaps.push_back(Range{at, size_ - at});
    at = size_;
  }
  written_.clear();
  if (at > 0) written_.emplace(0, at);
  return gaps;
}

bool OpenFile::overflowed() const {
  std::lock_guard lk(mu_);
  return overflowed_;
}

}  // namespace qcowfs::fuse
