#include "image/qcow2/l2.h"

#include <algorithm>

#include "image/qcow2/header.h"
#include "io/align.h"

namespace qcowfs::image::qcow2 {

Status corrupt(std::string msg) { return Status::error(EIO, std::move(msg)); }

namespace {

Status check_reserved_bits(const Geometry& g, uint64_t entry) {
  uint64_t reserved = kL2StandardReservedMask | (g.extended_l2 ? kOflagZero : 0);
  if (entry & reserved) return corrupt(fmt::format("L2 entry {:#x} has reserved bits set", entry));
  return Status::ok();
}

// Whether a standard entry names a host cluster.
bool names_host_cluster(const Geometry& g, uint64_t entry) {
  if (entry & kL2OffsetMask) return true;
  // Offset 0 is a real offset in an external data file when COPIED is set.
  return g.external_data && (entry & kOflagCopied);
}

Status check_host_cluster(const Geometry& g, uint64_t entry) {
  HostOffset host = entry & kL2OffsetMask;
  if (!is_aligned(host, g.cluster_size()))
    return corrupt(fmt::format("L2 entry {:#x}: host offset {:#x} is not cluster aligned", entry, host));
  if (g.external_data) return Status::ok();
  if (host < g.cluster_size()) return corrupt(fmt::format("L2 entry {:#x} points into the image header", entry));
  if (host >= g.image_file_size)
    return corrupt(fmt::format("L2 entry {:#x}: host offset {:#x} is beyond the end of the image file ({})", entry,
                               host, g.image_file_size));
  return Status::ok();
}

Status check_compressed(const Geometry& g, const L2EntryClass& c) {
  if (g.external_data)
    return corrupt(fmt::format("compressed L2 entry {:#x} in an image with an external data file", c.entry));
  if (c.bitmap != 0)
    return corrupt(fmt::format("compressed L2 entry {:#x} has a non-zero subcluster bitmap {:#x}", c.entry, c.bitmap));
  HostOffset host = c.compressed.host_offset;
  if (host >= kMaxHostOffset)
    return corrupt(fmt::format("compressed L2 entry {:#x}: offset {:#x} uses reserved bits", c.entry, host));
  if (host < g.cluster_size()) return corrupt(fmt::format("compressed L2 entry {:#x} points into the image header", c.entry));
  // The last sector may extend past a file that ends inside it; nothing more.
  if (host >= g.image_file_size || host + c.compressed.size > align_up(g.image_file_size, kCompressedSectorSize))
    return corrupt(fmt::format("compressed cluster at {:#x} ({} bytes) extends past the end of the image file ({})",
                               host, c.compressed.size, g.image_file_size));
  return Status::ok();
}

Status check_subcluster_bitmap(const L2EntryClass& c) {
  if (c.alloc_bits() & c.zero_bits())
    return corrupt(fmt::format("L2 entry {:#x}: subcluster bitmap {:#x} marks subclusters both allocated and zero",
                               c.entry, c.bitmap));
  if (!c.allocated && c.alloc_bits())
    return corrupt(fmt::format("L2 entry {:#x}: unallocated cluster has allocated subclusters (bitmap {:#x})", c.entry,
                               c.bitmap));
  return Status::ok();
}

Status check_entry(const Geometry& g, const L2EntryClass& c) {
  if (c.kind == L2Kind::compressed) return check_compressed(g, c);
  QCOWFS_TRY(check_reserved_bits(g, c.entry));
  if (c.allocated) QCOWFS_TRY(check_host_cluster(g, c.entry));  // ZERO_ALLOC still names a valid cluster
  if (g.extended_l2) QCOWFS_TRY(check_subcluster_bitmap(c));
  return Status::ok();
}

ExtentKind run_kind(SubclusterState s) {
  switch (s) {
    case SubclusterState::data: return ExtentKind::data;
    case SubclusterState::zero: return ExtentKind::zero;
    case SubclusterState::unallocated: return ExtentKind::unallocated;
  }
  return ExtentKind::unallocated;
}

// Where the run starting at in_cluster ends: the end of the last following
// subcluster in the same state, at most in_cluster + max_len.
uint64_t run_end(const Geometry& g, const L2EntryClass& c, uint64_t in_cluster, uint64_t max_len) {
  const uint64_t end = in_cluster + max_len;
  if (!g.extended_l2) return end;
  const uint64_t sc_size = g.subcluster_size();
  auto first = static_cast<unsigned>(in_cluster / sc_size);
  const SubclusterState state = c.subcluster(first);
  uint64_t stop = std::min(end, (uint64_t{first} + 1) * sc_size);
  for (unsigned sc = first + 1; stop < end && c.subcluster(sc) == state; ++sc)
    stop = std::min(end, (uint64_t{sc} + 1) * sc_size);
  return stop;
}

}  // namespace

Geometry make_geometry(const Header& h, uint64_t image_file_size) {
  return Geometry{h.cluster_bits, h.extended_l2(), h.has_external_data_file(), image_file_size};
}

CompressedCluster decode_compressed(uint32_t cluster_bits, uint64_t entry) {
  CompressedCluster c;
  uint32_t shift = compressed_size_shift(cluster_bits);
  c.host_offset = entry & compressed_offset_mask(cluster_bits);
  uint64_t sectors = ((entry >> shift) & compressed_sectors_mask(cluster_bits)) + 1;
  c.size = sectors * kCompressedSectorSize - (c.host_offset & (kCompressedSectorSize - 1));
  return c;
}

uint64_t encode_compressed(uint32_t cluster_bits, HostOffset host, uint64_t size) {
  const uint64_t extra_sectors = (host + size - 1) / kCompressedSectorSize - host / kCompressedSectorSize;
  return kOflagCompressed | (extra_sectors << compressed_size_shift(cluster_bits)) | host;
}

Result<uint64_t> decode_l1_entry(const Geometry& g, uint64_t l1_entry) {
  if (l1_entry & kL1ReservedMask) return corrupt(fmt::format("L1 entry {:#x} has reserved bits set", l1_entry));
  HostOffset l2 = l1_entry & kL1OffsetMask;
  if (l2 == 0) return uint64_t{0};
  if (!is_aligned(l2, g.cluster_size()))
    return corrupt(fmt::format("L2 table offset {:#x} is not cluster aligned", l2));
  if (l2 < g.cluster_size()) return corrupt(fmt::format("L2 table offset {:#x} points into the header", l2));
  if (l2 >= g.image_file_size || g.cluster_size() > g.image_file_size - l2)
    return corrupt(fmt::format("L2 table at {:#x} is beyond the end of the image file ({})", l2, g.image_file_size));
  return l2;
}

SubclusterState L2EntryClass::subcluster(unsigned sc) const {
  if (!extended) {
    if (kind == L2Kind::zero) return SubclusterState::zero;
    return kind == L2Kind::normal ? SubclusterState::data : SubclusterState::unallocated;
  }
  if (zero_bits() & (uint32_t{1} << sc)) return SubclusterState::zero;
  if (alloc_bits() & (uint32_t{1} << sc)) return SubclusterState::data;
  return SubclusterState::unallocated;
}

L2EntryClass decode_l2_entry(const Geometry& g, uint64_t entry, uint64_t bitmap) {
  L2EntryClass c;
  c.entry = entry;
  c.bitmap = g.extended_l2 ? bitmap : 0;
  c.extended = g.extended_l2;
  c.copied = (entry & kOflagCopied) != 0;
  if (entry & kOflagCompressed) {
    c.kind = L2Kind::compressed;
    c.compressed = decode_compressed(g.cluster_bits, entry);
    return c;
  }
  c.host = entry & kL2OffsetMask;
  c.allocated = names_host_cluster(g, entry);
  if (!g.extended_l2 && (entry & kOflagZero)) c.kind = L2Kind::zero;
  else c.kind = c.allocated ? L2Kind::normal : L2Kind::unallocated;
  return c;
}

Result<L2EntryClass> classify_l2_entry(const Geometry& g, uint64_t entry, uint64_t bitmap) {
  L2EntryClass c = decode_l2_entry(g, entry, bitmap);
  QCOWFS_TRY(check_entry(g, c));
  return c;
}

ClusterRun cluster_run(const Geometry& g, const L2EntryClass& c, uint64_t in_cluster, uint64_t max_len) {
  ClusterRun r;
  if (c.kind == L2Kind::compressed) {
    r.kind = ExtentKind::compressed;
    r.length = max_len;
    r.host_offset = c.compressed.host_offset;
    r.compressed = c.compressed;
    return r;
  }
  r.kind = run_kind(c.subcluster(static_cast<unsigned>(in_cluster / g.subcluster_size())));
  r.length = run_end(g, c, in_cluster, max_len) - in_cluster;
  if (c.mapped()) {
    r.host_offset = c.host + in_cluster;
    r.mapped = true;
  }
  return r;
}

Result<ClusterRun> decode_cluster_run(const Geometry& g, uint64_t entry, uint64_t bitmap, uint64_t in_cluster,
                                      uint64_t max_len) {
  auto c = classify_l2_entry(g, entry, bitmap);
  if (!c) return c.status();
  return cluster_run(g, *c, in_cluster, max_len);
}

}  // namespace qcowfs::image::qcow2
