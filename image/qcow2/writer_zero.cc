// Qcow2Writer: discard and write_zeroes. Whole clusters change their L2
// entries (unallocated, or zero flags with a backing file or when the host
// cluster is kept); partial clusters, and what a version 2 image cannot
// express over a backing file, are written as zero bytes through write().
#include <algorithm>

#include "image/qcow2/writer_plan.h"
#include "io/align.h"

namespace qcowfs::image::qcow2 {
namespace {

// Zero bytes written per write() when zeroing needs data.
constexpr uint64_t kZeroChunk = 1ull << 20;

}  // namespace

// What one cluster's L2 entry becomes.
struct Qcow2Writer::ZeroTarget {
  bool need_data = false;  // only a data write expresses it (version 2)
  uint64_t entry = 0, bitmap = 0;
  bool release = false;    // drop the old host cluster(s)
};

Task<Status> Qcow2Writer::discard(GuestOffset guest, uint64_t len) {
  co_return co_await zero_range(guest, len, ZeroMode::discard);
}

Task<Status> Qcow2Writer::write_zeroes(GuestOffset guest, uint64_t len, bool may_unmap) {
  co_return co_await zero_range(guest, len, may_unmap ? ZeroMode::zero_unmap : ZeroMode::zero_keep);
}

// The whole clusters of [guest, guest + len) (to the cluster end at the disk's
// end) change their entries; the partial ones are written (not on discard).
Task<Status> Qcow2Writer::zero_range(GuestOffset guest, uint64_t len, ZeroMode mode) {
  if (len == 0) co_return Status::ok();
  QCOWFS_CO_TRY(img_.corruption.refuse_writes());
  QCOWFS_CO_TRY(co_await prepare());
  note_guest_change(guest, len);
  const Geometry& g = img_.geometry;
  const uint64_t cs = g.cluster_size();
  const GuestOffset end = guest + len;
  const GuestOffset a = align_up(guest, cs);
  const GuestOffset b = end >= size() ? align_up(end, cs) : align_down(end, cs);
  const bool write_partial = mode != ZeroMode::discard;
  if (a >= b) {
    if (write_partial) QCOWFS_CO_TRY(co_await write_zero_bytes(guest, len));
    co_return Status::ok();
  }
  if (write_partial && guest < a) QCOWFS_CO_TRY(co_await write_zero_bytes(guest, a - guest));
  if (write_partial && b < end) QCOWFS_CO_TRY(co_await write_zero_bytes(b, end - b));
  std::vector<GuestCluster> need_data;
  QCOWFS_CO_TRY(co_await zero_clusters_locked(a >> g.cluster_bits, b >> g.cluster_bits, mode, need_data));
  QCOWFS_CO_TRY(co_await write_zero_clusters(need_data));
  co_return co_await maybe_writeback();
}

// zero_clusters under the exclusive range lock and the metadata lock.
Task<Status> Qcow2Writer::zero_clusters_locked(GuestCluster first_gc, GuestCluster end_gc, ZeroMode mode,
                                               std::vector<GuestCluster>& need_data) {
  const uint32_t bits = img_.geometry.cluster_bits;
  auto range = co_await reads_.ranges().lock(first_gc << bits, end_gc << bits, io::RangeLock::Mode::exclusive);
  // data_file_raw: the data file alone must read as the guest disk, so it
  // is zeroed first, as QEMU does, whatever the L2 entries will say.
  if (img_.header.data_file_raw()) {
    const GuestOffset a = first_gc << bits;
    QCOWFS_CO_TRY(co_await img_.data_file->write_zeroes(a, std::min(end_gc << bits, size()) - a));
  }
  auto m = co_await meta_.lock();
  auto zero = [&]() -> Task<Status> {
    need_data.clear();
    co_return co_await zero_clusters(first_gc, end_gc, mode, &need_data);
  };
  QCOWFS_CO_TRY(co_await with_refcount_room(m, zero));
  note_dirty_amount();
  co_return Status::ok();
}

// Metadata lock held. Clusters only a data write can zero go to *need_data.
Task<Status> Qcow2Writer::zero_clusters(GuestCluster first_gc, GuestCluster end_gc, ZeroMode mode,
                                        std::vector<GuestCluster>* need_data) {
  const uint64_t l2_entries = img_.geometry.l2_entries();
  const bool v3 = img_.header.version >= 3;
  const bool backing = has_backing();
  for (GuestCluster gc = first_gc; gc < end_gc; ++gc) {
    const uint64_t l1_index = gc / l2_entries;
    if ((l1_.entries[l1_index] & kL1OffsetMask) == 0 && !backing) {  // the whole L2 range reads as zeros
      gc = (l1_index + 1) * l2_entries - 1;
      continue;
    }
    if (!v3 && backing) {  // v2 cannot hide the backing file without data
      if (mode != ZeroMode::discard) need_data->push_back(gc);
      continue;
    }
    QCOWFS_CO_TRY(co_await zero_cluster(gc, mode, need_data));
  }
  co_return Status::ok();
}

Task<Status> Qcow2Writer::zero_cluster(GuestCluster gc, ZeroMode mode, std::vector<GuestCluster>* need_data) {
  const Geometry& g = img_.geometry;
  auto l2 = co_await ensure_l2(gc / g.l2_entries());
  if (!l2) co_return l2.status();
  size_t index = 0;
  auto slice = co_await slice_for(*l2, gc % g.l2_entries(), &index);
  if (!slice) co_return slice.status();
  const size_t esz = g.l2_entry_size();
  Slot probe;
  probe.gc = gc;
  probe.old_entry = slice->be64(index * esz);
  probe.old_bitmap = g.extended_l2 ? slice->be64(index * esz + kExtendedL2BitmapOffset) : 0;
  probe.rq_start = 0;
  probe.rq_end = g.cluster_size();
  QCOWFS_CO_TRY(classify(probe));
  const ZeroTarget t = zero_target(probe, mode);
  if (t.need_data) {
    need_data->push_back(gc);
    co_return Status::ok();
  }
  if (t.entry == probe.old_entry && t.bitmap == probe.old_bitmap) co_return Status::ok();
  QCOWFS_CO_TRY(co_await set_l2(*slice, index, t.entry, t.bitmap));
  if (t.release) release_old(probe.old_entry);
  co_return Status::ok();
}

// The new entry of a classified whole-cluster slot: zero_keep keeps an owned
// host cluster with the zero flag(s); otherwise unallocated without a backing
// file, zero flag(s) with one.
Qcow2Writer::ZeroTarget Qcow2Writer::zero_target(const Slot& s, ZeroMode mode) const {
  const Geometry& g = img_.geometry;
  const L2EntryClass old = decode_l2_entry(g, s.old_entry, s.old_bitmap);
  const bool compressed = old.kind == L2Kind::compressed;
  const bool owned = s.kind != Kind::allocate && !compressed;  // allocated and COPIED
  ZeroTarget t;
  t.release = compressed || old.host != 0;
  if (mode == ZeroMode::zero_keep && owned) {
    if (img_.header.version < 3) {
      t.need_data = true;
      return t;
    }
    t.entry = old.host | kOflagCopied | (g.extended_l2 ? 0 : kOflagZero);
    t.bitmap = kAllSubclustersZero;
    t.release = false;
  } else if (!has_backing()) {
    t.entry = 0;  // unallocated reads as zeros
  } else {
    t.entry = g.extended_l2 ? 0 : kOflagZero;
    t.bitmap = kAllSubclustersZero;
  }
  if (!g.extended_l2) t.bitmap = 0;
  return t;
}

Task<Status> Qcow2Writer::write_zero_bytes(GuestOffset guest, uint64_t len) {
  io::AlignedBuffer zeros(static_cast<size_t>(std::min(len, kZeroChunk)), img_.data_file->mem_align(), true);
  while (len > 0) {
    const uint64_t n = std::min(len, kZeroChunk);
    QCOWFS_CO_TRY(co_await write(guest, zeros.span().first(static_cast<size_t>(n))));
    guest += n;
    len -= n;
  }
  co_return Status::ok();
}

// Writes zero bytes over the (sorted) clusters gcs, one write per consecutive
// run, clipped at the disk's end.
Task<Status> Qcow2Writer::write_zero_clusters(const std::vector<GuestCluster>& gcs) {
  const uint32_t bits = img_.geometry.cluster_bits;
  for (size_t i = 0; i < gcs.size();) {
    size_t j = i + 1;
    while (j < gcs.size() && gcs[j] == gcs[j - 1] + 1) ++j;
    const GuestOffset start = gcs[i] << bits;
    const GuestOffset stop = std::min((gcs[j - 1] + 1) << bits, size());
    QCOWFS_CO_TRY(co_await write_zero_bytes(start, stop - start));
    i = j;
  }
  co_return Status::ok();
}

}  // namespace qcowfs::image::qcow2
