// qcow2 L1 and L2 entries: the pure part of the guest -> host mapping.
// classify_l2_entry() is the one place that reads the bits of an L2 entry
// (plus its subcluster bitmap with extended L2): kind, host cluster, COPIED
// flag, compressed descriptor, per-subcluster state, and the validation of
// reserved bits and offsets. decode_l2_entry() is the same reading without
// the validation (for `qcowfs check`, which reports problems as QEMU does
// instead of failing). decode_cluster_run() turns a classified entry and a
// position inside its cluster into a "run": how the following bytes read
// (host data, zeros, unallocated -> backing file, compressed) and for how long
// that stays true within the cluster (subclusters can split a cluster).
// Corrupt entries (reserved bits, misaligned or out-of-file offsets, a
// subcluster both allocated and zero) come back as EIO Statuses whose message
// names the problem; the caller adds the guest offset and logs it.
// Thread-safety: pure functions over values.
#pragma once

#include <cstdint>
#include <string>

#include "image/extent/map.h"
#include "image/qcow2/format.h"
#include "io/status.h"

namespace qcowfs::image::qcow2 {

struct Header;  // image/qcow2/header.h

// EIO with `msg`: metadata found corrupt while it is parsed (an entry, a table's place).
Status corrupt(std::string msg);

// What the mapping needs to know about an image, fixed at open.
struct Geometry {
  uint32_t cluster_bits = 16;
  bool extended_l2 = false;
  bool external_data = false;  // data clusters live in the external data file
  uint64_t image_file_size = 0;  // for range checks of metadata, data and compressed offsets

  uint64_t cluster_size() const { return uint64_t{1} << cluster_bits; }
  uint64_t subcluster_size() const { return extended_l2 ? cluster_size() / kSubclustersPerCluster : cluster_size(); }
  size_t l2_entry_size() const { return size_t{1} << l2_entry_bits(); }
  uint32_t l2_entry_bits() const { return extended_l2 ? kExtendedL2EntryBits : kL2EntryBits; }
  // A power of two, as a shift: divisions and remainders by it compile to
  // shifts and masks (the read path computes several per request).
  uint64_t l2_entries() const { return uint64_t{1} << (cluster_bits - l2_entry_bits()); }
};

// The geometry of an image with this header whose file is image_file_size bytes.
Geometry make_geometry(const Header& h, uint64_t image_file_size);

// Validates an L1 entry and returns its L2 table offset (0: unallocated).
Result<uint64_t> decode_l1_entry(const Geometry& g, uint64_t l1_entry);

struct CompressedCluster {
  uint64_t host_offset = 0;  // first byte of the compressed stream (unaligned)
  uint64_t size = 0;         // bytes to read from there
};

// How an L2 entry maps its guest cluster, as QEMU's qcow2_get_cluster_type()
// names it.
enum class L2Kind : uint8_t {
  unallocated,  // names no host cluster
  zero,         // standard entry with the zero flag (never with extended L2,
                // where that bit is reserved and per-subcluster zeros are used)
  normal,       // names a host cluster (extended L2: see subcluster())
  compressed,   // a compressed descriptor
};

// How one subcluster reads (the whole cluster without extended L2), as QEMU's
// qcow2_get_subcluster_type() names it.
enum class SubclusterState : uint8_t { data, zero, unallocated };

// One L2 entry, decoded.
struct L2EntryClass {
  uint64_t entry = 0;   // the raw entry
  uint64_t bitmap = 0;  // the raw subcluster bitmap (0 without extended L2)
  bool extended = false;
  L2Kind kind = L2Kind::unallocated;
  // The entry names a host cluster: a non-zero offset, or offset 0 with
  // COPIED in an external data file (COPIED, refcount 1, is always true
  // there). Never for a compressed descriptor. Also true for a zero entry
  // whose offset is set (QEMU's ZERO_ALLOC).
  bool allocated = false;
  HostOffset host = 0;  // entry & kL2OffsetMask (0 for compressed)
  bool copied = false;  // OFLAG_COPIED: the host cluster's refcount is 1
  CompressedCluster compressed;  // compressed: the whole cluster's stream

  uint32_t alloc_bits() const { return static_cast<uint32_t>(bitmap & kSubclusterAllocMask); }
  uint32_t zero_bits() const { return static_cast<uint32_t>(bitmap >> kSubclusterZeroShift); }
  // Reads go to `host` (data, and zero or unallocated (sub)clusters of a
  // cluster that names a host cluster). As in QEMU, a standard zero entry is
  // ZERO_ALLOC only with a non-zero offset.
  bool mapped() const { return allocated && (kind != L2Kind::zero || host != 0); }
  // Writable in place: a host cluster with refcount 1.
  bool owned() const { return allocated && copied; }
  // State of subcluster sc (0..31); without extended L2, of the whole
  // cluster (sc ignored). Not for compressed entries.
  SubclusterState subcluster(unsigned sc) const;
};

// Decodes the bits of an L2 entry without validating them. bitmap is ignored
// without extended L2.
L2EntryClass decode_l2_entry(const Geometry& g, uint64_t entry, uint64_t bitmap);

// decode_l2_entry() plus every validity check: reserved bits; a host cluster
// that is misaligned, in the header cluster or past the end of the image
// file; a subcluster both allocated and zero, or allocated subclusters
// without a host cluster; a compressed descriptor with an external data
// file, with a subcluster bitmap, or outside the image file. Each is an EIO
// whose message names the problem.
Result<L2EntryClass> classify_l2_entry(const Geometry& g, uint64_t entry, uint64_t bitmap);

// How a run reads (image/extent/map.h): data (host bytes at host_offset in
// the image file or external data file), zero, unallocated (the backing
// file's bytes, zeros without one) or compressed (part of a compressed cluster).
struct ClusterRun {
  ExtentKind kind = ExtentKind::unallocated;
  uint64_t length = 0;       // bytes from the queried position, within the cluster
  uint64_t host_offset = 0;  // data: host offset of the queried position
  // host_offset is set: data, and zero or unallocated (sub)clusters of a cluster
  // that names a host cluster (qemu's ZERO_ALLOC, UNALLOCATED_ALLOC).
  bool mapped = false;
  CompressedCluster compressed;  // compressed: the whole cluster's stream
};

// The run starting `in_cluster` bytes into the cluster a classified entry
// maps, at most max_len bytes long (max_len > 0, in_cluster + max_len <=
// cluster size).
ClusterRun cluster_run(const Geometry& g, const L2EntryClass& c, uint64_t in_cluster, uint64_t max_len);

// classify_l2_entry() then cluster_run(). bitmap is ignored without extended L2.
Result<ClusterRun> decode_cluster_run(const Geometry& g, uint64_t entry, uint64_t bitmap, uint64_t in_cluster,
                                      uint64_t max_len);

// Decodes a compressed descriptor (no range checks).
CompressedCluster decode_compressed(uint32_t cluster_bits, uint64_t entry);
// The compressed descriptor of a stream of `size` bytes (1 .. cluster size - 1)
// at byte `host` (at most compressed_offset_mask()), as QEMU writes it: the
// byte offset, the 512-byte sectors it touches after the first, no COPIED flag.
uint64_t encode_compressed(uint32_t cluster_bits, HostOffset host, uint64_t size);

}  // namespace qcowfs::image::qcow2
