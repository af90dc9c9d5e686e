#include "image/qcow2/snapshot_refcount.h"

#include "image/endian.h"
#include "image/extent/host_read.h"
#include "image/qcow2/l2.h"
#include "io/buffer.h"

namespace qcowfs::image::qcow2 {
namespace {

// One L2 table read whole, its entries decoded on demand.
class L2Table {
 public:
  L2Table(const Geometry& g, size_t mem_align) : g_(g), buf_(static_cast<size_t>(g.cluster_size()), mem_align) {}

  Task<Status> read(io::HostFile& file, HostOffset at) {
    at_ = at;
    co_return co_await read_padded(file, at, buf_.span(), "L2 table");
  }
  Task<Status> write(io::HostFile& file) const { co_return co_await file.write(at_, buf_.span()); }

  uint64_t entries() const { return g_.l2_entries(); }
  uint64_t entry(uint64_t i) const { return load_be64(at(i)); }
  uint64_t bitmap(uint64_t i) const { return g_.extended_l2 ? load_be64(at(i) + kExtendedL2BitmapOffset) : 0; }
  void set_entry(uint64_t i, uint64_t v) { store_be64(at(i), v); }

 private:
  const std::byte* at(uint64_t i) const { return buf_.data() + i * g_.l2_entry_size(); }
  std::byte* at(uint64_t i) { return buf_.data() + i * g_.l2_entry_size(); }

  const Geometry& g_;
  io::AlignedBuffer buf_;
  HostOffset at_ = 0;
};

// A reference more beyond the refcount width is QEMU's EINVAL (update_refcount()),
// found before RefcountTable::add() would call it a corruption.
Task<Status> add_refcount(SnapshotImage& im, HostCluster first, uint64_t n, int delta) {
  if (delta > 0) {
    const uint64_t max = im.refcounts->map().max();
    for (HostCluster hc = first; hc < first + n; ++hc) {
      auto v = co_await im.refcounts->get(hc);
      if (!v) co_return v.status();
      if (max - *v < static_cast<uint64_t>(delta))
        co_return Status::errorf(EINVAL, "refcount of cluster {:#x} would exceed {} (refcount_bits={})",
                                 hc << im.header.cluster_bits, max, im.header.refcount_bits());
    }
    co_return co_await im.refcounts->add(first, n, delta);
  }
  co_return co_await im.alloc->release(first, n, &im.freed);
}

// The host clusters one L2 entry references, as QEMU counts them.
struct EntryClusters {
  HostCluster first = 0;
  uint64_t count = 0;
};

Result<EntryClusters> entry_clusters(const Geometry& g, const L2Table& t, uint64_t i) {
  auto c = classify_l2_entry(g, t.entry(i), t.bitmap(i));
  if (!c) return c.status();
  if (c->kind == L2Kind::compressed) {
    const uint64_t first = c->compressed.host_offset >> g.cluster_bits;
    const uint64_t last = (c->compressed.host_offset + c->compressed.size - 1) >> g.cluster_bits;
    return EntryClusters{first, last - first + 1};
  }
  if (c->host != 0) return EntryClusters{c->host >> g.cluster_bits, 1};  // normal and zero with a host cluster
  return EntryClusters{};
}

Task<Status> add_l2_refcounts(SnapshotImage& im, const Geometry& g, L2Table& t, HostOffset l2, int delta) {
  QCOWFS_CO_TRY(co_await t.read(im.file, l2));
  for (uint64_t i = 0; i < t.entries(); ++i) {
    auto e = entry_clusters(g, t, i);
    if (!e) co_return e.status().with_context(fmt::format("L2 table at {:#x}, entry {}", l2, i));
    if (delta != 0 && e->count != 0) QCOWFS_CO_TRY(co_await add_refcount(im, e->first, e->count, delta));
  }
  if (delta != 0) QCOWFS_CO_TRY(co_await add_refcount(im, l2 >> g.cluster_bits, 1, delta));
  co_return Status::ok();
}

// Whether a cluster's refcount is exactly 1 (what OFLAG_COPIED must say).
Task<Result<bool>> owned(SnapshotImage& im, HostCluster hc) {
  auto r = co_await im.refcounts->get(hc);
  if (!r) co_return r.status();
  co_return *r == 1;
}

Task<Result<bool>> fix_l2_flags(SnapshotImage& im, const Geometry& g, L2Table& t) {
  bool changed = false;
  for (uint64_t i = 0; i < t.entries(); ++i) {
    const uint64_t old = t.entry(i);
    auto c = classify_l2_entry(g, old, t.bitmap(i));
    if (!c) co_return c.status();
    uint64_t entry = old & ~kOflagCopied;
    if (c->kind != L2Kind::compressed && c->host != 0) {
      auto one = co_await owned(im, c->host >> g.cluster_bits);
      if (!one) co_return one.status();
      if (*one) entry |= kOflagCopied;
    }
    if (entry != old) {
      t.set_entry(i, entry);
      changed = true;
    }
  }
  co_return changed;
}

}  // namespace

Task<Status> add_l1_refcounts(SnapshotImage& im, std::span<const uint64_t> l1, int delta) {
  const Geometry g = make_geometry(im.header, im.file.size());
  L2Table table(g, im.file.mem_align());
  for (size_t i = 0; i < l1.size(); ++i) {
    auto l2 = decode_l1_entry(g, l1[i]);
    if (!l2) co_return l2.status().with_context(fmt::format("L1 entry {}", i));
    if (*l2 != 0) QCOWFS_CO_TRY(co_await add_l2_refcounts(im, g, table, *l2, delta));
  }
  co_return Status::ok();
}

Task<Result<bool>> fix_copied_flags(SnapshotImage& im, std::vector<uint64_t>& l1) {
  const Geometry g = make_geometry(im.header, im.file.size());
  L2Table table(g, im.file.mem_align());
  bool l1_changed = false, l2_written = false;
  for (size_t i = 0; i < l1.size(); ++i) {
    auto l2 = decode_l1_entry(g, l1[i]);
    if (!l2) co_return l2.status().with_context(fmt::format("L1 entry {}", i));
    if (*l2 == 0) continue;
    QCOWFS_CO_TRY(co_await table.read(im.file, *l2));
    auto changed = co_await fix_l2_flags(im, g, table);
    if (!changed) co_return changed.status().with_context(fmt::format("L2 table at {:#x}", *l2));
    if (*changed) {
      QCOWFS_CO_TRY(co_await table.write(im.file));
      l2_written = true;
    }
    auto one = co_await owned(im, *l2 >> g.cluster_bits);
    if (!one) co_return one.status();
    const uint64_t entry = *one ? (l1[i] | kOflagCopied) : (l1[i] & ~kOflagCopied);
    l1_changed = l1_changed || entry != l1[i];
    l1[i] = entry;
  }
  if (l2_written) QCOWFS_CO_TRY(co_await im.file.flush());
  co_return l1_changed;
}

}  // namespace qcowfs::image::qcow2
