#include "io/remote/block_cache.h"

#include <algorithm>
#include <cstring>

#include "io/remote/read_iov.h"

namespace qcowfs::io {

BlockCache::BlockCache(uint64_t object_size, BlockCacheConfig cfg, Fetch fetch)
    : size_(object_size), cfg_(cfg), fetch_(std::move(fetch)) {}

BlockCache::BlockPtr BlockCache::acquire(uint64_t index, bool* started) {
  std::lock_guard lk(mu_);
  *started = false;
  auto it = blocks_.find(index);
  if (it != blocks_.end()) {
    BlockPtr b = it->second;
    if (b->in_lru) lru_.splice(lru_.begin(), lru_, b->lru);
    return b;
  }
  auto b = std::make_shared<Block>();
  b->index = index;
  b->generation = generation_;
  const uint64_t start = index * cfg_.block_size;
  b->data.resize(std::min(cfg_.block_size, size_ - start));
  blocks_.emplace(index, b);
  *started = true;
  return b;
}

void BlockCache::start_fetch(const BlockPtr& b) {
  fetch_(b->index * cfg_.block_size, b->data, [this, b](Status st) { finish(b, std::move(st)); });
}

void BlockCache::finish(const BlockPtr& b, Status st) {
  {
    std::lock_guard lk(mu_);
    auto it = blocks_.find(b->index);
    const bool current = it != blocks_.end() && it->second == b;
    readahead_in_flight_ -= b->readahead_reserved;
    b->readahead_reserved = 0;
    if (st && b->generation == generation_ && current) {
      lru_.push_front(b->index);
      b->lru = lru_.begin();
      b->in_lru = true;
      cached_bytes_ += b->data.size();
      stats_.bytes_fetched += b->data.size();
      evict_locked();
    } else {
      if (!st) ++stats_.failures;
      if (current) blocks_.erase(it);
    }
    b->status = std::move(st);
  }
  b->ready.set();
}

void BlockCache::evict_locked() {
  while (cached_bytes_ > cfg_.capacity && !lru_.empty()) {
    auto it = blocks_.find(lru_.back());
    lru_.pop_back();
    if (it == blocks_.end()) continue;
    cached_bytes_ -= it->second->data.size();
    it->second->in_lru = false;
    blocks_.erase(it);
  }
}

void BlockCache::invalidate_all() {
  std::lock_guard lk(mu_);
  ++generation_;
  blocks_.clear();
  lru_.clear();
  cached_bytes_ = 0;
}

BlockCacheStats BlockCache::stats() const {
  std::lock_guard lk(mu_);
  return stats_;
}

std::vector<uint64_t> BlockCache::plan_readahead(uint64_t off, uint64_t end) {
  std::lock_guard lk(mu_);
  const uint64_t bs = cfg_.block_size;
  const bool sequential = last_end_ != UINT64_MAX && (off > last_end_ ? off - last_end_ : last_end_ - off) <= bs;
  last_end_ = end;
  if (!sequential || cfg_.readahead_max == 0) {
    window_ = 0;
    return {};
  }
  window_ = window_ ? std::min(window_ * 2, cfg_.readahead_max) : std::min(bs, cfg_.readahead_max);
  std::vector<uint64_t> out;
  const uint64_t ra_end = std::min(size_, end + window_);
  for (uint64_t i = (end + bs - 1) / bs; i * bs < ra_end; ++i) {
    if (blocks_.contains(i)) continue;
    // The budget (at least one block) is taken: bounded memory, whatever the pattern.
    if (readahead_in_flight_ != 0 && readahead_in_flight_ + bs > cfg_.readahead_max) break;
    readahead_in_flight_ += bs;
    out.push_back(i);
  }
  return out;
}

Task<Result<size_t>> BlockCache::readv(uint64_t off, std::span<const iovec> iov) {
  return read_iov(off, iov, [this](uint64_t at, std::span<std::byte> buf) { return read(at, buf); });
}

Task<Result<size_t>> BlockCache::read(uint64_t off, std::span<std::byte> buf) {
  if (off >= size_ || buf.empty()) co_return size_t{0};
  const uint64_t end = std::min<uint64_t>(size_, off + buf.size());
  const uint64_t bs = cfg_.block_size;
  std::vector<BlockPtr> need;
  for (uint64_t i = off / bs; i * bs < end; ++i) {
    bool started = false;
    need.push_back(acquire(i, &started));
    {
      std::lock_guard lk(mu_);
      ++(started ? stats_.misses : stats_.hits);
    }
    if (started) start_fetch(need.back());
  }
  for (uint64_t i : plan_readahead(off, end)) {
    bool started = false;
    BlockPtr b = acquire(i, &started);
    {
      std::lock_guard lk(mu_);
      if (!started) {
        readahead_in_flight_ -= bs;  // another reader started it: not ours to hold
        continue;
      }
      b->readahead_reserved = bs;
      ++stats_.readahead;
    }
    start_fetch(b);
  }
  for (const BlockPtr& b : need) {
    co_await b->ready.wait();
    if (!b->status) co_return b->status;
    const uint64_t bstart = b->index * bs;
    const uint64_t from = std::max(off, bstart);
    const uint64_t to = std::min<uint64_t>(end, bstart + b->data.size());
    std::memcpy(buf.data() + (from - off), b->data.data() + (from - bstart), to - from);
  }
  co_return static_cast<size_t>(end - off);
}

}  // namespace qcowfs::io
