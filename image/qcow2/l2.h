// Decoding of qcow2 L1 and L2 entries into "runs": the pure part of the guest
// -> host mapping. Given one (extended) L2 entry and a position inside its
// cluster, decode_cluster_run() says how the following bytes read (host data,
// zeros, unallocated -> backing file, compressed) and for how long that stays
// true within the cluster (subclusters can split a cluster into several runs).
// Corrupt entries (reserved bits, misaligned or out-of-file offsets, a
// subcluster both allocated and zero) come back as EIO Statuses whose message
// names the problem; the caller adds the guest offset and logs it.
// Thread-safety: pure functions over values.
#pragma once

#include <cstdint>

#include "image/qcow2/format.h"
#include "io/status.h"

namespace qcowfs::image::qcow2 {

// What the mapping needs to know about an image, fixed at open.
struct Geometry {
  uint32_t cluster_bits = 16;
  bool extended_l2 = false;
  bool external_data = false;  // data clusters live in the external data file
  uint64_t image_file_size = 0;  // for range checks of metadata, data and compressed offsets

  uint64_t cluster_size() const { return uint64_t{1} << cluster_bits; }
  uint64_t subcluster_size() const { return extended_l2 ? cluster_size() / kSubclustersPerCluster : cluster_size(); }
  size_t l2_entry_size() const { return extended_l2 ? kExtendedL2EntrySize : kL2EntrySize; }
  uint64_t l2_entries() const { return cluster_size() / l2_entry_size(); }
};

// Validates an L1 entry and returns its L2 table offset (0: unallocated).
Result<uint64_t> decode_l1_entry(const Geometry& g, uint64_t l1_entry);

enum class RunKind : uint8_t {
  data,         // host bytes at host_offset (image file or external data file)
  zero,         // reads as zeros, no I/O
  unallocated,  // reads from the backing file (zeros without one)
  compressed,   // part of a compressed cluster
};

struct CompressedCluster {
  uint64_t host_offset = 0;  // first byte of the compressed stream (unaligned)
  uint64_t size = 0;         // bytes to read from there
};

struct ClusterRun {
  RunKind kind = RunKind::unallocated;
  uint64_t length = 0;       // bytes from the queried position, within the cluster
  uint64_t host_offset = 0;  // data: host offset of the queried position
  // host_offset is set: data, and zero or unallocated (sub)clusters of a cluster
  // that names a host cluster (qemu's ZERO_ALLOC, UNALLOCATED_ALLOC).
  bool mapped = false;
  CompressedCluster compressed;  // compressed: the whole cluster's stream
};

// Decodes the run starting `in_cluster` bytes into the cluster described by
// (entry, bitmap), at most max_len bytes long (max_len > 0, in_cluster +
// max_len <= cluster size). bitmap is ignored without extended L2.
Result<ClusterRun> decode_cluster_run(const Geometry& g, uint64_t entry, uint64_t bitmap, uint64_t in_cluster,
                                      uint64_t max_len);

// Decodes a compressed descriptor (no range checks).
CompressedCluster decode_compressed(uint32_t cluster_bits, uint64_t entry);

}  // namespace qcowfs::image::qcow2
