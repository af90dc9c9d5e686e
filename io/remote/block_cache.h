// BlockCache: reads of a remote object through a bounded in-memory LRU of
// cached ranges. A read waits for the ranges it covers, fetching the missing
// ones; a range being fetched is shared by every reader that wants it.
//
// Fetch policy (deterministic: it depends only on the reads' offsets and what
// is cached or under way, never on timing):
// - A read is sequential when the byte before it is cached or being fetched
//   (so reads of one stream that arrive out of order, into what was read
//   ahead, still count). A sequential read grows
//   the readahead window (one block, then doubling up to readahead_max); any
//   other read closes it.
// - Sequential reads, and reads of a block or more, fetch whole blocks
//   (block_size, aligned). Other reads, when small_fetch is set, fetch only the
//   small_fetch-aligned granules they cover (a 4 KiB random read fetches 4 KiB
//   rather than a block); a block already cached or under way is used as is.
// - Adjacent ranges started by one read are fetched by one request of at most
//   max_request bytes (0: one block): a sequential stream fetches megabytes
//   per request rather than a block. Readahead tops the window up only when a
//   request's worth of it (max_request, at most half the window) is missing,
//   and in whole requests (but for the object's last blocks): what the budget
//   or the request size cuts off waits for the next top-up, so concurrent
//   sequential readers ride one stream of full-size requests.
//
// Fetches go through a Fetch function given at construction: it starts the
// transfer of [off, off + total) into the buffers (adjacent in the object, in
// order) and calls done(status) exactly once, on any thread, after filling
// them. Waiters are resumed on their own engine (io::AsyncEvent).
//
// Memory: at most capacity bytes of finished ranges, plus those being
// fetched: the reads under way, and blocks read ahead, which are never more
// than readahead_max bytes (or one request) in flight at once, whatever the
// access pattern (a readahead past that budget is left out, not queued). Block
// buffers of evicted blocks are recycled (as many are kept as the cache holds
// at its fullest), never zero-filled.
// Thread-safety: read() may be called concurrently from any event-loop thread;
// done callbacks may come from any thread. The cache must outlive every fetch
// it started (the owner stops its transfers before destroying it).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <span>
#include <sys/uio.h>
#include <unordered_map>
#include <vector>

#include "io/status.h"
#include "io/sync.h"
#include "io/task.h"

namespace qcowfs::io {

struct BlockCacheConfig {
  uint64_t block_size = 256 * 1024;
  uint64_t capacity = 64 * 1024 * 1024;
  uint64_t readahead_max = 4 * 1024 * 1024;
  uint64_t max_request = 0;  // most bytes one fetch covers (adjacent blocks coalesced); 0: one block
  uint64_t small_fetch = 0;  // granule of small non-sequential reads (a power of two below block_size); 0: blocks
};

struct BlockCacheStats {
  uint64_t hits = 0;          // ranges found ready or already being fetched
  uint64_t misses = 0;        // ranges a read had to fetch
  uint64_t readahead = 0;     // blocks fetched ahead of the reader
  uint64_t small = 0;         // small_fetch granules fetched (of misses)
  uint64_t requests = 0;      // fetches started (adjacent ranges share one)
  uint64_t bytes_fetched = 0;
  uint64_t failures = 0;      // ranges whose fetch failed
  uint64_t buffers = 0;       // block buffers allocated (recycled ones are not counted)
};

class BlockCache {
 public:
  // Buffers filled one after another from a fetch's offset.
  using Buffers = std::vector<std::span<std::byte>>;
  using Fetch = std::function<void(uint64_t off, Buffers dst, std::function<void(Status)> done)>;

  BlockCache(uint64_t object_size, BlockCacheConfig cfg, Fetch fetch);
  ~BlockCache();
  BlockCache(const BlockCache&) = delete;
  BlockCache& operator=(const BlockCache&) = delete;

  // Reads up to buf.size() bytes at off (fewer only at the object's end).
  Task<Result<size_t>> read(uint64_t off, std::span<std::byte> buf);
  // The same into several buffers, one after another from off.
  Task<Result<size_t>> readv(uint64_t off, std::span<const iovec> iov);
  // Drops every finished range (a writer changed the object); ranges being
  // fetched are dropped when they finish.
  void invalidate_all();
  BlockCacheStats stats() const;
  const BlockCacheConfig& config() const { return cfg_; }

 private:
  class BufferPool;
  struct Range;
  using RangePtr = std::shared_ptr<Range>;
  struct Plan;

  // Key of a block (index i: 2i) or a small granule (index j: 2j + 1).
  static uint64_t block_key(uint64_t i) { return i << 1; }
  static uint64_t small_key(uint64_t j) { return (j << 1) | 1; }

  // The ranges read [off, end) needs and the ones it starts (mu_ held).
  void plan_locked(uint64_t off, uint64_t end, Plan& plan);
  // Readahead ranges after a sequential read ending at end (mu_ held).
  void plan_readahead_locked(uint64_t end, Plan& plan);
  // Whether a read at off is sequential; grows or closes the window.
  bool sequential_locked(uint64_t off);
  RangePtr find_locked(uint64_t key);
  RangePtr create_locked(uint64_t key, uint64_t off, uint64_t len);
  // Starts the fetches of started (in offset order), adjacent ones together.
  void start_fetches(const std::vector<RangePtr>& started);
  void finish(const std::vector<RangePtr>& ranges, const Status& st);
  void evict_locked();

  const uint64_t size_;
  const BlockCacheConfig cfg_;
  const Fetch fetch_;
  const std::unique_ptr<BufferPool> pool_;  // declared before ranges_: outlives the ranges returning buffers to it

  mutable std::mutex mu_;  // guards everything below
  std::unordered_map<uint64_t, RangePtr> ranges_;  // by key
  std::list<uint64_t> lru_;  // keys of finished ranges, most recent at the front
  uint64_t cached_bytes_ = 0;
  uint64_t generation_ = 0;
  uint64_t window_ = 0;             // current readahead in bytes
  uint64_t readahead_in_flight_ = 0;  // bytes of read-ahead blocks being fetched (<= readahead_max or one request)
  BlockCacheStats stats_;
};

}  // namespace qcowfs::io
