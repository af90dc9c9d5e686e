// RefcountTable: the qcow2 refcount structures of one writable image. The
// refcount table (reftable) lives in memory; refcount blocks are loaded on
// demand into a bounded cache and written back (never written through): every
// change marks its block dirty, and the metadata writeback (image/qcow2/metadata.h)
// copies dirty blocks and new reftable entries out in the order the
// crash-consistency rules need.
//
// Entries are refcount_bits = 1 << refcount_order wide (1..64), located and
// accessed through RefcountMap (image/qcow2/refcount_entry.h). Going above the
// maximum or below zero is an EIO (corrupt image or a bug), never a wrap.
//
// Growing the reftable writes a new, larger table elsewhere (with any new
// refcount blocks it needs, which cover themselves), flushes, switches the two
// header fields in one write, flushes again and only then frees the old table.
//
// Thread-safety: none, except table_offset(). Every other call is made with
// the image's metadata lock held (Qcow2Writer::meta); grow() also needs the
// writeback lock, so that no writeback copies blocks out while it writes them.
// table_offset() may be read without the lock (the data write path's overlap
// check): grow() publishes the new offset with release ordering before it
// frees the old table, so a reader that can see the old table's clusters
// reused (through the lock that ordered the reuse) sees the new offset. Block data stays alive while a caller holds its
// shared_ptr ("pinned"); eviction only drops clean blocks nobody holds.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <vector>

#include "image/qcow2/refcount_entry.h"
#include "io/buffer.h"
#include "io/host_file.h"
#include "io/status.h"
#include "io/task.h"

namespace qcowfs::image::qcow2 {

// Points the header at a refcount table: refcount_table_offset and
// refcount_table_clusters are adjacent, so this is one write (no flush).
Task<Status> write_reftable_location(io::HostFile& file, HostOffset table, uint32_t table_clusters);

// Big-endian bytes of reftable entries, zero-padded to `bytes`.
io::AlignedBuffer serialize_reftable(std::span<const uint64_t> table, size_t bytes, size_t mem_align);

class RefcountTable {
 public:
  struct Block {
    uint64_t host_offset = 0;
    io::AlignedBuffer data;
    uint64_t gen = 0;          // bumped on every change
    uint64_t written_gen = 0;  // generation known to be on disk
    bool dirty() const { return gen != written_gen; }
  };
  // A copy of one dirty block for the writeback.
  struct DirtyBlock {
    uint64_t index = 0;  // reftable index
    uint64_t host_offset = 0;
    std::vector<std::byte> bytes;
    uint64_t gen = 0;
  };

  // table: the reftable entries (host order) read from table_offset.
  RefcountTable(io::HostFile& file, uint32_t cluster_bits, uint32_t refcount_order, uint64_t table_offset,
                std::vector<uint64_t> table, size_t cache_blocks);
  // Reads the reftable described by the header fields.
  static Task<Result<std::unique_ptr<RefcountTable>>> load(io::HostFile& file, uint32_t cluster_bits,
                                                           uint32_t refcount_order, uint64_t table_offset,
                                                           uint32_t table_clusters, size_t cache_blocks);

  const RefcountMap& map() const { return map_; }
  uint64_t cluster_size() const { return map_.cluster_size(); }
  uint32_t refcount_order() const { return map_.order(); }
  uint64_t block_entries() const { return map_.block_entries(); }
  uint64_t table_offset() const { return table_offset_.load(std::memory_order_acquire); }
  uint64_t table_entries() const { return table_.size(); }
  uint32_t table_clusters() const;
  uint64_t table_entry(uint64_t index) const { return index < table_.size() ? table_[index] : 0; }
  // Clusters covered by the current reftable.
  uint64_t covered_clusters() const { return table_.size() * block_entries(); }

  // Refcount of host cluster hc (0 where no block exists).
  Task<Result<uint64_t>> get(HostCluster hc);
  // Without I/O: the refcount when it is known (block cached or absent).
  std::optional<uint64_t> peek(HostCluster hc) const;
  // Loads the block holding hc's refcount into the cache (no-op when absent or cached).
  Task<Status> load_block_for(HostCluster hc);
  // Adds delta to the refcounts of host clusters [first_hc, first_hc + n). The
  // blocks must exist. EIO on overflow, underflow or a missing block; nothing
  // changes then.
  Task<Status> add(HostCluster first_hc, uint64_t n, int64_t delta);
  // Whether reftable entry `index` names a block.
  bool has_block(uint64_t index) const { return table_entry(index) != 0; }
  // Creates an all-zero block for reftable `index` at host cluster hc (the
  // caller has made sure that cluster is free and will count it).
  void install_block(uint64_t index, HostCluster hc);

  // Grows the reftable to at least min_entries, placing the new table and the
  // blocks it needs at host cluster at_hc and after (all free). Performs the
  // write/flush/header switch sequence, then drops the old table's refcounts.
  // Returns the first host cluster after what it used.
  Task<Result<HostCluster>> grow(uint64_t min_entries, HostCluster at_hc);

  // Writeback support.
  std::vector<DirtyBlock> dirty_blocks() const;
  void mark_block_written(uint64_t index, uint64_t gen);
  // Reftable entries changed since last written: (index, value).
  std::vector<std::pair<uint64_t, uint64_t>> dirty_table_entries() const;
  void mark_table_entry_written(uint64_t index, uint64_t value);
  bool has_dirty() const;
  size_t dirty_block_count() const;
  // True once add() met an impossible refcount (overflow, underflow, no block):
  // the image's metadata is inconsistent.
  bool corruption_found() const { return corruption_found_; }

  // Highest host cluster with a non-zero refcount, plus one (0 if none). Loads the last blocks.
  Task<Result<HostCluster>> end_of_used();

 private:
  using BlockPtr = std::shared_ptr<Block>;
  Task<Result<BlockPtr>> block(uint64_t index);
  BlockPtr cached(uint64_t index) const;
  void evict();
  Task<Status> write_blocks_now();
  // A grown reftable placed at at_hc: its size, and the reftable indices
  // of the blocks it needs that do not exist yet (placed right after it).
  struct Growth {
    uint64_t table_clusters = 0;
    std::vector<uint64_t> missing;
  };
  Growth plan_growth(uint64_t min_entries, HostCluster at_hc) const;
  std::vector<uint64_t> missing_blocks(HostCluster at_hc, uint64_t table_clusters) const;
  // Writes the grown table's blocks and the table, flushes, switches the
  // header to it and flushes again.
  Task<Status> write_grown(HostCluster at_hc, uint64_t table_clusters);

  io::HostFile& file_;
  const RefcountMap map_;
  std::atomic<uint64_t> table_offset_;  // the only field read without the metadata lock
  std::vector<uint64_t> table_;
  std::set<uint64_t> dirty_table_;  // reftable indices changed in memory
  std::map<uint64_t, BlockPtr> blocks_;
  const size_t cache_blocks_;
  bool corruption_found_ = false;
};

}  // namespace qcowfs::image::qcow2
