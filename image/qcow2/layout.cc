#include "image/qcow2/layout.h"

#include <algorithm>

#include "image/endian.h"
#include "image/qcow2/l2.h"
#include "io/align.h"
#include "io/buffer.h"

namespace qcowfs::image::qcow2 {
namespace {

// A table of `bytes` at `host`: aligned, inside the file, not in the header.
Status check_table(const Header& h, uint64_t file_size, HostOffset host, uint64_t bytes, const std::string& what) {
  const uint64_t cs = h.cluster_size();
  if (!is_aligned(host, cs)) return corrupt(fmt::format("{} at {:#x} is not cluster aligned", what, host));
  if (host < cs) return corrupt(fmt::format("{} at {:#x} is inside the header cluster", what, host));
  if (host >= file_size || bytes > file_size - host)
    return corrupt(fmt::format("{} at {:#x} ({} bytes) lies beyond the end of the file ({})", what, host, bytes,
                               file_size));
  return Status::ok();
}

Status add_table(MetadataLayout& m, const Header& h, uint64_t file_size, HostOffset host, uint64_t bytes,
                 std::string what) {
  QCOWFS_TRY(check_table(h, file_size, host, bytes, what));
  return m.add(MetadataRange{host, host + align_up(bytes, h.cluster_size()), std::move(what)});
}

Task<Status> add_refcount_blocks(MetadataLayout& m, io::HostFile& f, const Header& h, uint64_t file_size) {
  const uint64_t cs = h.cluster_size();
  const uint64_t bytes = uint64_t{h.refcount_table_clusters} * cs;
  io::AlignedBuffer table(static_cast<size_t>(bytes), f.mem_align(), true);
  auto n = co_await f.read(h.refcount_table_offset, table.span());
  if (!n) co_return n.status().with_context("reading the refcount table");
  for (uint64_t i = 0; i < bytes / sizeof(uint64_t); ++i) {  // reftable entries: big-endian u64
    uint64_t e = load_be64(table.data() + i * sizeof(uint64_t));
    if (e == 0) continue;
    if (e & ~kReftableOffsetMask) co_return corrupt(fmt::format("refcount table entry {} ({:#x}) has reserved bits set", i, e));
    QCOWFS_CO_TRY(add_table(m, h, file_size, e, cs, fmt::format("refcount block {}", i)));
  }
  co_return Status::ok();
}

Status add_l2_tables(MetadataLayout& m, const Header& h, uint64_t file_size, std::span<const uint64_t> l1) {
  for (size_t i = 0; i < l1.size(); ++i) {
    uint64_t l2 = l1[i] & kL1OffsetMask;
    if (l2 == 0) continue;
    if (l1[i] & kL1ReservedMask)
      return corrupt(fmt::format("L1 entry {} ({:#x}) has reserved bits set", i, l1[i]));
    QCOWFS_TRY(add_table(m, h, file_size, l2, h.cluster_size(), fmt::format("L2 table of L1 entry {}", i)));
  }
  return Status::ok();
}

}  // namespace

const MetadataRange* MetadataLayout::overlap(HostOffset host, uint64_t len) const {
  auto it = std::upper_bound(ranges_.begin(), ranges_.end(), host,
                             [](HostOffset h, const MetadataRange& r) { return h < r.start; });
  if (it != ranges_.begin() && std::prev(it)->end > host) return &*std::prev(it);
  if (it != ranges_.end() && it->start < host + len) return &*it;
  return nullptr;
}

Status MetadataLayout::add(MetadataRange r) {
  if (const MetadataRange* o = overlap(r.start, r.end - r.start))
    return corrupt(fmt::format("{} at {:#x} overlaps {} at {:#x}", r.what, r.start, o->what, o->start));
  auto it = std::upper_bound(ranges_.begin(), ranges_.end(), r.start,
                             [](HostOffset h, const MetadataRange& x) { return h < x.start; });
  ranges_.insert(it, std::move(r));
  return Status::ok();
}

Task<Result<MetadataLayout>> build_metadata_layout(io::HostFile& file, const Header& h,
                                                   std::span<const uint64_t> l1,
                                                   const std::vector<Snapshot>& snapshots) {
  const uint64_t size = file.size();
  MetadataLayout m;
  QCOWFS_CO_TRY(m.add(MetadataRange{0, h.cluster_size(), "header"}));
  if (h.l1_size > 0) QCOWFS_CO_TRY(add_table(m, h, size, h.l1_table_offset, uint64_t{h.l1_size} * sizeof(uint64_t), "L1 table"));
  QCOWFS_CO_TRY(add_table(m, h, size, h.refcount_table_offset,
                          uint64_t{h.refcount_table_clusters} * h.cluster_size(), "refcount table"));
  QCOWFS_CO_TRY(co_await add_refcount_blocks(m, file, h, size));
  QCOWFS_CO_TRY(add_l2_tables(m, h, size, l1));
  if (h.nb_snapshots > 0) {
    // The table's length is known only by parsing it; its first cluster is enough to catch overlaps.
    QCOWFS_CO_TRY(add_table(m, h, size, h.snapshots_offset, 1, "snapshot table"));
  }
  for (size_t i = 0; i < snapshots.size(); ++i) {
    const Snapshot& s = snapshots[i];
    if (s.l1_size == 0) continue;
    // Snapshot L1 tables may be shared with nothing else; a clash with the active metadata is corruption.
    QCOWFS_CO_TRY(add_table(m, h, size, s.l1_table_offset, uint64_t{s.l1_size} * sizeof(uint64_t),
                            fmt::format("L1 table of snapshot '{}'", s.name)));
  }
  co_return m;
}

}  // namespace qcowfs::image::qcow2
