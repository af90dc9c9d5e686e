// Metadata write-back for a writable qcow2 image: what the write path changed
// in memory (L2 slices, L1 entries, refcount blocks, reftable entries, cluster
// references dropped) and the one routine that writes it out in crash-safe
// order. image/qcow2/DESIGN.md "Write ordering" states the rules.
//
// A writeback is a WritebackBatch: copies of everything dirty, taken in one
// step under the metadata lock, so the copies are mutually consistent (every
// L2 entry in the batch has its refcount increase in the batch's refcount
// blocks and its data already written). write_batch() then runs the stages
// without any lock but the writeback lock:
//
//   stage 1  refcount blocks                 -> flush (data + refcounts durable)
//            new reftable entries            -> flush
//   stage 2  L2 slices                       -> flush (only if L1 entries follow)
//            L1 entries
//   stage 3  flush; then (back under the metadata lock) the batch's deferred
//            releases are applied: refcount decreases of clusters the written
//            L2/L1 entries no longer use.
//
// Changes made while a batch is in flight stay dirty (generation counters) and
// go out with the next batch.
//
// Thread-safety: MetadataTracker is not synchronised; callers hold the image's
// metadata lock. write_batch() touches only its batch and the files.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "image/extent/table_cache.h"
#include "image/qcow2/refcount.h"
#include "io/host_file.h"
#include "io/status.h"
#include "io/task.h"

namespace qcowfs::image::qcow2 {

// A run of host clusters whose reference is dropped once a batch is durable.
struct DeferredRelease {
  uint64_t first_cluster = 0;
  uint64_t count = 0;
};

struct WritebackBatch {
  struct Slice {
    uint64_t offset = 0;
    std::vector<std::byte> bytes;
    uint64_t gen = 0;
  };
  std::vector<RefcountTable::DirtyBlock> blocks;
  std::vector<std::pair<uint64_t, uint64_t>> reftable_entries;  // (index, value)
  uint64_t reftable_offset = 0;
  std::vector<Slice> l2;
  std::vector<std::pair<uint64_t, uint64_t>> l1_entries;  // (index, value)
  uint64_t l1_offset = 0;
  uint64_t l1_gen = 0;  // L1 changes up to this generation are in the batch
  std::vector<DeferredRelease> releases;
  bool data_written = false;
  bool empty() const {
    return blocks.empty() && reftable_entries.empty() && l2.empty() && l1_entries.empty() && releases.empty();
  }
};

class MetadataTracker {
 public:
  // Records that the L2 slice at `offset` changed again; false when it is not
  // tracked yet, and the caller hands over a pinned Ref with add_l2().
  bool touch_l2(uint64_t offset);
  // Starts tracking a changed slice; keeps it pinned (and dirty) until written.
  void add_l2(TableCache::Ref ref, TableCache& cache);
  void l1_changed(uint64_t index) { l1_dirty_.insert_or_assign(index, ++l1_gen_); }
  // Drops a reference to [first, first + n) after the next completed writeback.
  void release_later(uint64_t first_cluster, uint64_t n) { releases_.push_back({first_cluster, n}); }
  void data_written() { data_written_ = true; }

  size_t dirty_l2_slices() const { return l2_.size(); }
  bool has_dirty() const { return !l2_.empty() || !l1_dirty_.empty() || !releases_.empty(); }

  // Copies everything dirty (caller holds the metadata lock).
  WritebackBatch take(const RefcountTable& rt, const std::vector<uint64_t>& l1, uint64_t l1_offset);
  // After write_batch succeeded: clears what the batch wrote (unless changed since).
  void written(const WritebackBatch& b, RefcountTable& rt, TableCache& cache);
  // After write_batch failed: keeps the batch's releases and data flag for the next try.
  void failed(const WritebackBatch& b);

 private:
  struct DirtySlice {
    TableCache::Ref ref;
    uint64_t gen = 0;
  };
  std::map<uint64_t, DirtySlice> l2_;     // by slice host offset
  std::map<uint64_t, uint64_t> l1_dirty_; // L1 index -> generation
  uint64_t l1_gen_ = 0;
  uint64_t l2_gen_ = 0;
  std::vector<DeferredRelease> releases_;
  bool data_written_ = false;
};

// Writes a batch in the staged order above and flushes `file` (and
// `data_file` when it is a different file) at least once.
Task<Status> write_batch(io::HostFile& file, io::HostFile& data_file, const WritebackBatch& b);

}  // namespace qcowfs::image::qcow2
