// TableCache: a bounded LRU cache of metadata table slices read from one host
// file, keyed by host offset: qcow2's L2 tables (shared by every view of one
// image: active image and snapshots), QED's L2 tables, VMDK's grain tables.
//
// A slice is `slice_size` bytes of one table (4 KiB by default; a format may
// use its whole table size), loaded with one host read. get() returns a Ref that pins
// the slice: pinned slices are never evicted, so a Ref stays valid while it is
// held. Concurrent get()s of a slice that is not yet loaded share one host read
// (the first caller loads, the others await an AsyncEvent). A failed load is
// reported to every waiter and forgotten, so a later get() retries.
//
// Capacity is counted in slices. When every cached slice is pinned or dirty
// the cache grows past its capacity rather than block; it shrinks back as Refs
// are released and slices are loaded.
//
// Write-path hooks: a slice's bytes are mutable through a Ref; mark_dirty()
// keeps a slice out of eviction until clear_dirty() says it was written back.
//
// Thread-safety: all methods are thread-safe. The internal mutex is held only
// in non-suspending code; Refs may be moved between threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <span>
#include <unordered_map>
#include <vector>

#include "io/buffer.h"
#include "io/host_file.h"
#include "io/status.h"
#include "io/sync.h"
#include "io/task.h"

namespace qcowfs::image {

class TableCache {
  struct Entry;

 public:
  // Default cache size: enough slices to map the whole disk, at most 32 MiB
  // (QEMU's default cap), at least 8 slices.
  static constexpr uint64_t kDefaultMaxBytes = 32ull << 20;
  static constexpr uint64_t kDefaultMinSlices = 8;
  static constexpr size_t kDefaultSliceSize = 4096;
  static uint64_t default_size(uint64_t l2_bytes_for_whole_disk, size_t slice_size);
  // True when the process runs with QCOWFS_TINY_CACHE=1 in its environment
  // (tests/run-all.sh's tiny-cache pass): every cache then holds two slices,
  // whatever its size says, so eviction runs in every test.
  static bool tiny();

  // Pinned handle on a loaded slice.
  class Ref {
   public:
    Ref() = default;
    Ref(Ref&& o) noexcept;
    Ref& operator=(Ref&& o) noexcept;
    Ref(const Ref&) = delete;
    Ref& operator=(const Ref&) = delete;
    ~Ref();
    void reset();
    explicit operator bool() const { return entry_ != nullptr; }

    uint64_t host_offset() const;
    std::span<const std::byte> bytes() const;
    std::span<std::byte> mutable_bytes();
    // The integer at byte offset `at` of the slice, in host order (qcow2's
    // tables are big-endian, QED's and VMDK's little-endian).
    uint64_t be64(size_t at) const;
    uint64_t le64(size_t at) const;
    uint32_t le32(size_t at) const;

   private:
    friend class TableCache;
    Ref(TableCache* c, std::shared_ptr<Entry> e) : cache_(c), entry_(std::move(e)) {}
    TableCache* cache_ = nullptr;
    std::shared_ptr<Entry> entry_;
  };

  // file must outlive the cache. capacity_bytes is rounded down to whole
  // slices (at least two).
  TableCache(io::HostFile& file, size_t slice_size, uint64_t capacity_bytes);
  TableCache(const TableCache&) = delete;
  TableCache& operator=(const TableCache&) = delete;

  // The slice starting at host offset `host` (aligned to slice_size, inside
  // the file: the caller validates it).
  Task<Result<Ref>> get(uint64_t host);
  // The slice if it is cached and loaded (pinned, moved to the LRU front);
  // otherwise an error Status and nothing changes. Never suspends.
  Result<Ref> try_get(uint64_t host);
  // Copies out.size() bytes at `at` of the slice at `host` when it is cached
  // and loaded (moved to the LRU front), under one mutex round and with no
  // pin: for a caller whose range lock keeps those bytes from changing and
  // that needs no more of the slice afterwards. False (out untouched) when
  // try_get would fail. Never suspends.
  bool try_read(uint64_t host, size_t at, std::span<std::byte> out);
  // The file the slices are read from (and written back to).
  io::HostFile& file() const { return file_; }

  void mark_dirty(Ref& ref);
  void clear_dirty(Ref& ref);

  size_t slice_size() const { return slice_size_; }
  size_t capacity_slices() const { return capacity_; }
  size_t cached_slices() const;
  uint64_t host_reads() const;  // slice loads issued (for tests)

 private:
  struct Entry {
    uint64_t host = 0;
    // Slices of at least a page live in an aligned buffer (zero-copy reads);
    // smaller ones (clusters under 4 KiB) in plain memory, so a 512-byte slice
    // costs 512 bytes and the cache's memory stays what its capacity says.
    io::AlignedBuffer aligned;
    std::vector<std::byte> small;
    std::span<std::byte> data;
    io::AsyncEvent loaded;
    Status load_status;  // written by the loader before loaded.set()
    // Guarded by TableCache::mu_:
    int pins = 0;
    bool dirty = false;
    std::list<uint64_t>::iterator lru;
  };

  Task<Status> load(Entry& e);
  void evict_locked();
  void unpin(Entry& e);
  void forget_locked(const std::shared_ptr<Entry>& e);

  io::HostFile& file_;
  const size_t slice_size_;
  const size_t capacity_;

  mutable io::AdaptiveMutex mu_;  // guards map_, lru_, Entry::pins/dirty/lru, host_reads_
  std::unordered_map<uint64_t, std::shared_ptr<Entry>> map_;
  std::list<uint64_t> lru_;  // front = most recently used
  uint64_t host_reads_ = 0;
};

}  // namespace qcowfs::image
