#include "image/qcow2/l2.h"

#include <algorithm>

#include "io/align.h"

namespace qcowfs::image::qcow2 {
namespace {

Status corrupt(std::string msg) { return Status::error(EIO, std::move(msg)); }

enum class SubType : uint8_t { normal, zero, unallocated };

Status check_standard_entry(const Geometry& g, uint64_t entry) {
  uint64_t reserved = kL2StandardReservedMask | (g.extended_l2 ? kOflagZero : 0);
  if (entry & reserved) return corrupt(fmt::format("L2 entry {:#x} has reserved bits set", entry));
  return Status::ok();
}

// Whether a standard entry names a host cluster.
bool entry_allocated(const Geometry& g, uint64_t entry) {
  if (entry & kL2OffsetMask) return true;
  // Offset 0 is a real offset in an external data file when COPIED is set.
  return g.external_data && (entry & kOflagCopied);
}

Status check_host_cluster(const Geometry& g, uint64_t entry) {
  uint64_t host = entry & kL2OffsetMask;
  if (!is_aligned(host, g.cluster_size()))
    return corrupt(fmt::format("L2 entry {:#x}: host offset {:#x} is not cluster aligned", entry, host));
  if (g.external_data) return Status::ok();
  if (host < g.cluster_size()) return corrupt(fmt::format("L2 entry {:#x} points into the image header", entry));
  if (host >= g.image_file_size)
    return corrupt(fmt::format("L2 entry {:#x}: host offset {:#x} is beyond the end of the image file ({})", entry,
                               host, g.image_file_size));
  return Status::ok();
}

Result<ClusterRun> decode_compressed_run(const Geometry& g, uint64_t entry, uint64_t bitmap, uint64_t max_len) {
  if (g.external_data) return corrupt(fmt::format("compressed L2 entry {:#x} in an image with an external data file", entry));
  if (g.extended_l2 && bitmap != 0)
    return corrupt(fmt::format("compressed L2 entry {:#x} has a non-zero subcluster bitmap {:#x}", entry, bitmap));
  CompressedCluster c = decode_compressed(g.cluster_bits, entry);
  if (c.host_offset >= kMaxHostOffset)
    return corrupt(fmt::format("compressed L2 entry {:#x}: offset {:#x} uses reserved bits", entry, c.host_offset));
  if (c.host_offset < g.cluster_size())
    return corrupt(fmt::format("compressed L2 entry {:#x} points into the image header", entry));
  // The last sector may extend past a file that ends inside it; nothing more.
  if (c.host_offset >= g.image_file_size ||
      c.host_offset + c.size > align_up(g.image_file_size, kCompressedSectorSize))
    return corrupt(fmt::format("compressed cluster at {:#x} ({} bytes) extends past the end of the image file ({})",
                               c.host_offset, c.size, g.image_file_size));
  ClusterRun r;
  r.kind = RunKind::compressed;
  r.length = max_len;
  r.host_offset = c.host_offset;
  r.compressed = c;
  return r;
}

Result<SubType> subcluster_type(uint64_t entry, bool allocated, uint64_t bitmap, unsigned sc) {
  uint64_t alloc = bitmap & kSubclusterAllocMask;
  uint64_t zero = bitmap >> kSubclusterZeroShift;
  if (alloc & zero)
    return corrupt(fmt::format("L2 entry {:#x}: subcluster bitmap {:#x} marks subclusters both allocated and zero",
                               entry, bitmap));
  if (!allocated && alloc)
    return corrupt(fmt::format("L2 entry {:#x}: unallocated cluster has allocated subclusters (bitmap {:#x})", entry,
                               bitmap));
  if (zero & (uint64_t{1} << sc)) return SubType::zero;
  if (alloc & (uint64_t{1} << sc)) return SubType::normal;
  return SubType::unallocated;
}

Result<ClusterRun> decode_extended_run(const Geometry& g, uint64_t entry, uint64_t bitmap, uint64_t in_cluster,
                                       uint64_t max_len) {
  bool allocated = entry_allocated(g, entry);
  if (allocated) QCOWFS_TRY(check_host_cluster(g, entry));
  uint64_t sc_size = g.subcluster_size();
  auto first = static_cast<unsigned>(in_cluster / sc_size);
  auto type = subcluster_type(entry, allocated, bitmap, first);
  if (!type) return type.status();
  uint64_t end = in_cluster + max_len;
  uint64_t run_end = std::min(end, (uint64_t{first} + 1) * sc_size);
  for (unsigned sc = first + 1; run_end < end; ++sc) {
    auto t = subcluster_type(entry, allocated, bitmap, sc);
    if (!t) return t.status();
    if (*t != *type) break;
    run_end = std::min(end, (uint64_t{sc} + 1) * sc_size);
  }
  ClusterRun r;
  r.length = run_end - in_cluster;
  r.kind = *type == SubType::normal ? RunKind::data : *type == SubType::zero ? RunKind::zero : RunKind::unallocated;
  if (allocated) {
    r.host_offset = (entry & kL2OffsetMask) + in_cluster;
    r.mapped = true;
  }
  return r;
}

}  // namespace

CompressedCluster decode_compressed(uint32_t cluster_bits, uint64_t entry) {
  CompressedCluster c;
  uint32_t shift = compressed_size_shift(cluster_bits);
  c.host_offset = entry & compressed_offset_mask(cluster_bits);
  uint64_t sectors = ((entry >> shift) & compressed_sectors_mask(cluster_bits)) + 1;
  c.size = sectors * kCompressedSectorSize - (c.host_offset & (kCompressedSectorSize - 1));
  return c;
}

Result<uint64_t> decode_l1_entry(const Geometry& g, uint64_t l1_entry) {
  if (l1_entry & kL1ReservedMask) return corrupt(fmt::format("L1 entry {:#x} has reserved bits set", l1_entry));
  uint64_t l2 = l1_entry & kL1OffsetMask;
  if (l2 == 0) return uint64_t{0};
  if (!is_aligned(l2, g.cluster_size()))
    return corrupt(fmt::format("L2 table offset {:#x} is not cluster aligned", l2));
  if (l2 < g.cluster_size()) return corrupt(fmt::format("L2 table offset {:#x} points into the header", l2));
  if (l2 >= g.image_file_size || g.cluster_size() > g.image_file_size - l2)
    return corrupt(fmt::format("L2 table at {:#x} is beyond the end of the image file ({})", l2, g.image_file_size));
  return l2;
}

Result<ClusterRun> decode_cluster_run(const Geometry& g, uint64_t entry, uint64_t bitmap, uint64_t in_cluster,
                                      uint64_t max_len) {
  if (entry & kOflagCompressed) return decode_compressed_run(g, entry, bitmap, max_len);
  QCOWFS_TRY(check_standard_entry(g, entry));
  if (g.extended_l2) return decode_extended_run(g, entry, bitmap, in_cluster, max_len);
  ClusterRun r;
  r.length = max_len;
  bool allocated = entry_allocated(g, entry);
  if (entry & kOflagZero) {
    if (allocated) QCOWFS_TRY(check_host_cluster(g, entry));  // ZERO_ALLOC still names a valid cluster
    r.kind = RunKind::zero;
    // As in QEMU, only a non-zero offset makes a zero cluster ZERO_ALLOC.
    if (entry & kL2OffsetMask) {
      r.host_offset = (entry & kL2OffsetMask) + in_cluster;
      r.mapped = true;
    }
    return r;
  }
  if (!allocated) {
    r.kind = RunKind::unallocated;
    return r;
  }
  QCOWFS_TRY(check_host_cluster(g, entry));
  r.kind = RunKind::data;
  r.host_offset = (entry & kL2OffsetMask) + in_cluster;
  r.mapped = true;
  return r;
}

}  // namespace qcowfs::image::qcow2
