// qcow2 refcounts inside refcount blocks, at every refcount width: 2^order
// bits per entry, order 0..6 (1..64 bits). Entries of a byte or more are
// big-endian; narrower ones pack into bytes with entry 0 in the least
// significant bits (docs/interop/qcow2.txt, "Refcount blocks").
// RefcountMap is the one accessor of refcount blocks that the writer's
// RefcountTable (image/qcow2/refcount.h), `qcowfs check` and image creation
// share: which reftable entry names the block holding a host cluster's
// refcount, which entry of that block it is, and reading and writing it.
// Reading blocks from the file (cached or not) is the caller's.
// Thread-safety: pure functions and an immutable value type; the blocks are
// the caller's buffers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "image/qcow2/format.h"

namespace qcowfs::image::qcow2 {

// Entry `index` of `block`; the block must hold it.
uint64_t get_refcount_entry(std::span<const std::byte> block, uint64_t index, uint32_t order);
// Stores the low 2^order bits of value as entry `index`, leaving its neighbours alone.
void set_refcount_entry(std::span<std::byte> block, uint64_t index, uint32_t order, uint64_t value);

// Largest refcount a 2^order-bit entry holds.
constexpr uint64_t max_refcount(uint32_t order) {
  return order >= 6 ? ~uint64_t{0} : (uint64_t{1} << (uint64_t{1} << order)) - 1;
}

// Where the refcount of a host cluster lives, for one cluster size and
// refcount width: in entry entry_index(hc) of the refcount block that
// reftable entry table_index(hc) names.
class RefcountMap {
 public:
  RefcountMap(uint32_t cluster_bits, uint32_t refcount_order) : cluster_bits_(cluster_bits), order_(refcount_order) {}

  uint32_t cluster_bits() const { return cluster_bits_; }
  uint64_t cluster_size() const { return uint64_t{1} << cluster_bits_; }
  uint32_t order() const { return order_; }
  uint64_t max() const { return max_refcount(order_); }
  // Refcounts one block holds.
  uint64_t block_entries() const { return (cluster_size() * 8) >> order_; }
  uint64_t table_index(HostCluster hc) const { return hc / block_entries(); }
  uint64_t entry_index(HostCluster hc) const { return hc % block_entries(); }

  // Host offset of the block covering hc that `table` (reftable entries,
  // masked or not) names; 0 past the table's end or for an empty entry.
  HostOffset block_offset(std::span<const uint64_t> table, HostCluster hc) const {
    uint64_t index = table_index(hc);
    return index < table.size() ? table[index] & kReftableOffsetMask : 0;
  }

  // The refcount of hc in `block`, the block covering it.
  uint64_t get(std::span<const std::byte> block, HostCluster hc) const {
    return get_refcount_entry(block, entry_index(hc), order_);
  }
  void set(std::span<std::byte> block, HostCluster hc, uint64_t value) const {
    set_refcount_entry(block, entry_index(hc), order_, value);
  }

  // Blocks covering host clusters [0, clusters), and reftable clusters
  // naming that many blocks.
  uint64_t blocks_for(uint64_t clusters) const { return (clusters + block_entries() - 1) / block_entries(); }
  uint64_t table_clusters_for(uint64_t blocks) const {
    return (blocks * kReftableEntrySize + cluster_size() - 1) / cluster_size();
  }

 private:
  uint32_t cluster_bits_;
  uint32_t order_;
};

}  // namespace qcowfs::image::qcow2
