#include "io/remote/block_cache.h"

#include <algorithm>
#include <bit>
#include <cstring>

#include "io/remote/read_iov.h"

namespace qcowfs::io {

// Buffers of one size (a block), kept for reuse up to a count: a stream's
// blocks cost no allocation (nor the kernel's zeroing of fresh pages) once
// the cache is full. Other sizes are plain allocations. Thread-safe.
class BlockCache::BufferPool {
 public:
  BufferPool(size_t size, size_t keep) : size_(size), keep_(keep) {}

  std::unique_ptr<std::byte[]> get(size_t n) {
    if (n == size_) {
      std::lock_guard lk(mu_);
      if (!free_.empty()) {
        auto p = std::move(free_.back());
        free_.pop_back();
        return p;
      }
      ++allocated_;
    }
    return std::unique_ptr<std::byte[]>(new std::byte[n]);  // not zero-filled: a fetch fills it
  }
  void put(std::unique_ptr<std::byte[]> p, size_t n) {
    if (!p || n != size_) return;
    std::lock_guard lk(mu_);
    if (free_.size() < keep_) free_.push_back(std::move(p));
  }
  uint64_t allocated() {
    std::lock_guard lk(mu_);
    return allocated_;
  }

 private:
  const size_t size_;
  const size_t keep_;
  std::mutex mu_;
  std::vector<std::unique_ptr<std::byte[]>> free_;
  uint64_t allocated_ = 0;  // buffers of size_ made (not taken from free_)
};

struct BlockCache::Range {
  Range(BufferPool& p, uint64_t k, uint64_t o, uint64_t n, uint64_t gen)
      : pool(p), key(k), off(o), len(n), generation(gen), mem(p.get(n)) {}
  ~Range() { pool.put(std::move(mem), len); }
  std::span<std::byte> data() const { return {mem.get(), len}; }

  BufferPool& pool;
  const uint64_t key;
  const uint64_t off;
  const uint64_t len;
  const uint64_t generation;
  std::unique_ptr<std::byte[]> mem;
  Status status;
  AsyncEvent ready;
  std::list<uint64_t>::iterator lru;
  bool in_lru = false;
  uint64_t readahead_reserved = 0;  // bytes of readahead_in_flight_ this fetch holds
};

struct BlockCache::Plan {
  std::vector<RangePtr> need;     // what the read copies from, in offset order
  std::vector<RangePtr> started;  // of need, the ones it fetches
  std::vector<RangePtr> ahead;    // blocks read ahead
};

namespace {

BlockCacheConfig checked(BlockCacheConfig c) {
  if (c.small_fetch >= c.block_size || !std::has_single_bit(c.small_fetch)) c.small_fetch = 0;
  c.max_request = std::max(c.max_request, c.block_size);
  return c;
}

// Block buffers kept for reuse: as many as the cache holds at its fullest
// (capacity plus the readahead budget), so a buffer is freed only at the end
// and the memory kept never exceeds what the cache itself may hold. Fewer (16
// before) freed the buffers of each eviction burst and took fresh ones for the
// next readahead: a quarter of a sequential stream's pages were faulted in anew
// (and zeroed by the kernel) inside the network thread's copy.
size_t pooled_buffers(const BlockCacheConfig& c) {
  return static_cast<size_t>((c.capacity + std::max(c.readahead_max, c.max_request)) / c.block_size);
}

}  // namespace

BlockCache::BlockCache(uint64_t object_size, BlockCacheConfig cfg, Fetch fetch)
    : size_(object_size),
      cfg_(checked(cfg)),
      fetch_(std::move(fetch)),
      pool_(std::make_unique<BufferPool>(cfg_.block_size, pooled_buffers(cfg_))) {}

BlockCache::~BlockCache() = default;

BlockCache::RangePtr BlockCache::find_locked(uint64_t key) {
  auto it = ranges_.find(key);
  if (it == ranges_.end()) return nullptr;
  const RangePtr& r = it->second;
  if (r->in_lru) lru_.splice(lru_.begin(), lru_, r->lru);
  return r;
}

BlockCache::RangePtr BlockCache::create_locked(uint64_t key, uint64_t off, uint64_t len) {
  auto r = std::make_shared<Range>(*pool_, key, off, len, generation_);
  ranges_.emplace(key, r);
  return r;
}

bool BlockCache::sequential_locked(uint64_t off) {
  bool seq = false;
  if (off > 0) {
    const uint64_t before = off - 1;
    seq = ranges_.contains(block_key(before / cfg_.block_size)) ||
          (cfg_.small_fetch && ranges_.contains(small_key(before / cfg_.small_fetch)));
  }
  if (!seq || cfg_.readahead_max == 0) {
    window_ = 0;
    return seq;
  }
  window_ = window_ ? std::min(window_ * 2, cfg_.readahead_max) : std::min(cfg_.block_size, cfg_.readahead_max);
  return true;
}

void BlockCache::plan_locked(uint64_t off, uint64_t end, Plan& plan) {
  const uint64_t bs = cfg_.block_size;
  const uint64_t g = cfg_.small_fetch;
  const bool seq = sequential_locked(off);
  const bool small = !seq && g != 0 && end - off < bs;
  for (uint64_t pos = off; pos < end;) {
    const uint64_t bi = pos / bs;
    RangePtr r = find_locked(block_key(bi));
    if (!r && small) {
      const uint64_t j = pos / g;
      r = find_locked(small_key(j));
      if (!r) {
        r = create_locked(small_key(j), j * g, std::min(g, size_ - j * g));
        plan.started.push_back(r);
        ++stats_.small;
      }
    } else if (!r) {
      r = create_locked(block_key(bi), bi * bs, std::min(bs, size_ - bi * bs));
      plan.started.push_back(r);
    }
    ++(plan.started.empty() || plan.started.back() != r ? stats_.hits : stats_.misses);
    plan.need.push_back(r);
    pos = r->off + r->len;
  }
  if (seq && window_ != 0) plan_readahead_locked(end, plan);
}

void BlockCache::plan_readahead_locked(uint64_t end, Plan& plan) {
  const uint64_t bs = cfg_.block_size;
  const uint64_t ra_end = std::min(size_, end + window_);
  std::vector<uint64_t> missing;
  for (uint64_t i = (end + bs - 1) / bs; i * bs < ra_end; ++i) {
    if (!ranges_.contains(block_key(i))) missing.push_back(i);
  }
  // Top the window up a request's worth at a time (big requests), except at the object's end.
  const uint64_t chunk = std::max(bs, std::min(cfg_.max_request, window_ / 2));
  if (missing.empty() || (missing.size() * bs < chunk && ra_end < size_)) return;
  // The budget (at least one request) is taken: bounded memory, whatever the pattern.
  const uint64_t budget = std::max(cfg_.readahead_max, cfg_.max_request);
  size_t n = 0;
  for (uint64_t bytes = 0; n < missing.size(); ++n) {
    const uint64_t len = std::min(bs, size_ - missing[n] * bs);
    if (readahead_in_flight_ + bytes + len > budget) break;
    bytes += len;
  }
  // Whole requests only (but for the object's last blocks): a window topped
  // up by 3 MiB would otherwise go out as 2 + 1 MiB; the rest waits for the
  // next top-up, as does a request that does not fit in the budget yet.
  if (n < missing.size() || ra_end < size_) {
    const size_t per_request = static_cast<size_t>(chunk / bs);
    n -= n % per_request;
  }
  if (n == 0) return;
  for (uint64_t i : std::span(missing).first(n)) {
    const uint64_t len = std::min(bs, size_ - i * bs);
    RangePtr r = create_locked(block_key(i), i * bs, len);
    r->readahead_reserved = len;
    readahead_in_flight_ += len;
    ++stats_.readahead;
    plan.ahead.push_back(std::move(r));
  }
}

void BlockCache::start_fetches(const std::vector<RangePtr>& started) {
  for (size_t i = 0; i < started.size();) {
    auto group = std::make_shared<std::vector<RangePtr>>();
    Buffers dst;
    uint64_t bytes = 0;
    do {
      const RangePtr& r = started[i];
      if (!group->empty() && (group->back()->off + group->back()->len != r->off || bytes + r->len > cfg_.max_request))
        break;
      group->push_back(r);
      dst.push_back(r->data());
      bytes += r->len;
    } while (++i < started.size());
    const uint64_t off = group->front()->off;
    fetch_(off, std::move(dst), [this, group](Status st) { finish(*group, st); });
  }
}

void BlockCache::finish(const std::vector<RangePtr>& ranges, const Status& st) {
  {
    std::lock_guard lk(mu_);
    ++stats_.requests;
    for (const RangePtr& r : ranges) {
      auto it = ranges_.find(r->key);
      const bool current = it != ranges_.end() && it->second == r;
      readahead_in_flight_ -= r->readahead_reserved;
      r->readahead_reserved = 0;
      if (st && r->generation == generation_ && current) {
        lru_.push_front(r->key);
        r->lru = lru_.begin();
        r->in_lru = true;
        cached_bytes_ += r->len;
        stats_.bytes_fetched += r->len;
      } else {
        if (!st) ++stats_.failures;
        if (current) ranges_.erase(it);
      }
      r->status = st;
    }
    evict_locked();
  }
  for (const RangePtr& r : ranges) r->ready.set();
}

void BlockCache::evict_locked() {
  while (cached_bytes_ > cfg_.capacity && !lru_.empty()) {
    auto it = ranges_.find(lru_.back());
    lru_.pop_back();
    if (it == ranges_.end()) continue;
    cached_bytes_ -= it->second->len;
    it->second->in_lru = false;
    ranges_.erase(it);
  }
}

void BlockCache::invalidate_all() {
  std::lock_guard lk(mu_);
  ++generation_;
  for (auto it = ranges_.begin(); it != ranges_.end();) {
    it->second->in_lru = false;
    it = ranges_.erase(it);
  }
  lru_.clear();
  cached_bytes_ = 0;
}

BlockCacheStats BlockCache::stats() const {
  std::lock_guard lk(mu_);
  BlockCacheStats s = stats_;
  s.buffers = pool_->allocated();
  return s;
}

Task<Result<size_t>> BlockCache::readv(uint64_t off, std::span<const iovec> iov) {
  return read_iov(off, iov, [this](uint64_t at, std::span<std::byte> buf) { return read(at, buf); });
}

Task<Result<size_t>> BlockCache::read(uint64_t off, std::span<std::byte> buf) {
  if (off >= size_ || buf.empty()) co_return size_t{0};
  const uint64_t end = std::min<uint64_t>(size_, off + buf.size());
  Plan plan;
  {
    std::lock_guard lk(mu_);
    plan_locked(off, end, plan);
  }
  start_fetches(plan.started);
  start_fetches(plan.ahead);
  for (const RangePtr& r : plan.need) {
    co_await r->ready.wait();
    if (!r->status) co_return r->status;
    const uint64_t from = std::max(off, r->off);
    const uint64_t to = std::min(end, r->off + r->len);
    std::memcpy(buf.data() + (from - off), r->mem.get() + (from - r->off), to - from);
  }
  co_return static_cast<size_t>(end - off);
}

}  // namespace qcowfs::io
