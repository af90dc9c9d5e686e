// BlockCache: reads of a remote object through fixed-size blocks kept in a
// bounded in-memory LRU. A read waits for the blocks it covers, fetching the
// missing ones (all at once, so several requests are in flight); a block being
// fetched is shared by every reader that wants it. Sequential reads start a
// readahead window that doubles with each sequential read up to a limit;
// a read elsewhere turns it off. A failed fetch fails the readers waiting for
// it and is forgotten, so the next read fetches again.
//
// Fetches go through a Fetch function given at construction: it starts the
// transfer and calls done(status) exactly once, on any thread, after filling
// dst. Waiters are resumed on their own engine (io::AsyncEvent).
//
// Memory: at most capacity bytes of finished blocks, plus the blocks being
// fetched: the reads under way, and blocks read ahead, which are never more
// than readahead_max bytes (or one block) in flight at once, whatever the
// access pattern (a readahead past that budget is left out, not queued).
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
};

struct BlockCacheStats {
  uint64_t hits = 0;          // blocks found ready or already being fetched
  uint64_t misses = 0;        // blocks a read had to fetch
  uint64_t readahead = 0;     // blocks fetched ahead of the reader
  uint64_t bytes_fetched = 0;
  uint64_t failures = 0;      // fetches that failed
};

class BlockCache {
 public:
  using Fetch = std::function<void(uint64_t off, std::span<std::byte> dst, std::function<void(Status)> done)>;

  BlockCache(uint64_t object_size, BlockCacheConfig cfg, Fetch fetch);
  BlockCache(const BlockCache&) = delete;
  BlockCache& operator=(const BlockCache&) = delete;

  // Reads up to buf.size() bytes at off (fewer only at the object's end).
  Task<Result<size_t>> read(uint64_t off, std::span<std::byte> buf);
  // The same into several buffers, one after another from off.
  Task<Result<size_t>> readv(uint64_t off, std::span<const iovec> iov);
  // Drops every finished block (a writer changed the object); blocks being
  // fetched are dropped when they finish.
  void invalidate_all();
  BlockCacheStats stats() const;
  const BlockCacheConfig& config() const { return cfg_; }

 private:
  struct Block {
    uint64_t index = 0;
    uint64_t generation = 0;
    std::vector<std::byte> data;
    Status status;
    AsyncEvent ready;
    std::list<uint64_t>::iterator lru;
    bool in_lru = false;
    uint64_t readahead_reserved = 0;  // bytes of readahead_in_flight_ this fetch holds
  };
  using BlockPtr = std::shared_ptr<Block>;

  // Returns the block, starting its fetch when it is neither cached nor under
  // way. *started says whether this call started it. Takes mu_.
  BlockPtr acquire(uint64_t index, bool* started);
  void start_fetch(const BlockPtr& b);
  void finish(const BlockPtr& b, Status st);
  void evict_locked();
  // Blocks to read ahead after a read of [off, end), by the sequential pattern,
  // each with a block's worth of the readahead budget reserved.
  std::vector<uint64_t> plan_readahead(uint64_t off, uint64_t end);

  const uint64_t size_;
  const BlockCacheConfig cfg_;
  const Fetch fetch_;

  mutable std::mutex mu_;  // guards everything below
  std::unordered_map<uint64_t, BlockPtr> blocks_;
  std::list<uint64_t> lru_;  // finished blocks, most recent at the front
  uint64_t cached_bytes_ = 0;
  uint64_t generation_ = 0;
  uint64_t last_end_ = UINT64_MAX;  // where the previous read ended
  uint64_t window_ = 0;             // current readahead in bytes
  uint64_t readahead_in_flight_ = 0;  // bytes of read-ahead blocks being fetched (<= readahead_max or one block)
  BlockCacheStats stats_;
};

}  // namespace qcowfs::io
