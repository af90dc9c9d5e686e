// Qcow2Writer: mapping a request onto host clusters (classify each guest
// cluster, create or copy L2 tables) and allocating the host run of its new
// clusters, with preallocation ahead of small writes into fresh clusters.
#include <algorithm>

#include "image/endian.h"
#include "image/qcow2/writer_plan.h"
#include "io/align.h"

namespace qcowfs::image::qcow2 {

// The slot of guest cluster gc for the request [guest, guest + len).
Qcow2Writer::Slot Qcow2Writer::request_slot(GuestCluster gc, GuestOffset guest, uint64_t len) const {
  const Geometry& g = img_.geometry;
  const uint64_t cs = g.cluster_size();
  const GuestCluster first_gc = guest >> g.cluster_bits, last_gc = (guest + len - 1) >> g.cluster_bits;
  Slot s;
  s.gc = gc;
  s.rq_start = gc == first_gc ? guest & (cs - 1) : 0;
  s.rq_end = gc == last_gc ? ((guest + len - 1) & (cs - 1)) + 1 : cs;
  return s;
}

Result<HostOffset> Qcow2Writer::l2_table_of(uint64_t l1_entry, uint64_t l1_index) const {
  auto decoded = decode_l1_entry(img_.geometry, l1_entry);
  if (!decoded) return corruption(fmt::format("L1 entry {}: {}", l1_index, decoded.status().message()));
  return *decoded;
}

// Reads slot s's L2 entry (table l2_table) into s, pinning its slice in the
// plan (consecutive slots of one slice share the pin), and classifies it.
Task<Status> Qcow2Writer::load_entry(Plan& plan, Slot& s, HostOffset l2_table) {
  const HostOffset slice_host = slice_of(s, l2_table);
  if (!pin_cached_slice(plan, slice_host)) {
    auto ref = co_await img_.l2_cache->get(slice_host);
    if (!ref)
      co_return ref.status().with_context(fmt::format("guest offset {:#x}", s.gc << img_.geometry.cluster_bits));
    plan.slices.push_back(std::move(*ref));
  }
  co_return take_entry(plan, s);
}

HostOffset Qcow2Writer::slice_of(const Slot& s, HostOffset l2_table) const {
  const uint64_t l2_index = s.gc % img_.geometry.l2_entries();
  return l2_table + (l2_index / img_.l2_slice_entries()) * img_.l2_cache->slice_size();
}

// Whether the plan's last slice is the one at slice_host, after pinning it
// from the cache when it is cached and loaded (no suspension).
bool Qcow2Writer::pin_cached_slice(Plan& plan, HostOffset slice_host) const {
  if (!plan.slices.empty() && plan.slices.back().host_offset() == slice_host) return true;
  auto ref = img_.l2_cache->try_get(slice_host);
  if (!ref) return false;  // not cached, loading or failed: get() waits or reports it
  plan.slices.push_back(std::move(*ref));
  return true;
}

// Reads slot s's entry (and extended L2 bitmap) straight from the cached
// slice at slice_host, without pinning it: false when the slice is not
// cached and loaded. For map_overwrite only: the shared range lock keeps
// this cluster's entry from changing (every mapping change holds it
// exclusive), and an overwrite needs nothing of the slice after classifying
// (write_data uses the slot's host offset; only commit() writes entries).
bool Qcow2Writer::read_cached_entry(Slot& s, HostOffset slice_host) const {
  const Geometry& g = img_.geometry;
  const size_t esz = g.l2_entry_size();
  const size_t index = static_cast<size_t>((s.gc % g.l2_entries()) % img_.l2_slice_entries());
  std::byte raw[2 * sizeof(uint64_t)];
  if (!img_.l2_cache->try_read(slice_host, index * esz, std::span(raw, esz))) return false;
  s.index = index;
  s.old_entry = load_be64(raw);
  s.old_bitmap = g.extended_l2 ? load_be64(raw + kExtendedL2BitmapOffset) : 0;
  return true;
}

// Reads slot s's entry from the plan's last slice (the slot's) and classifies it.
Status Qcow2Writer::take_entry(Plan& plan, Slot& s) const {
  const Geometry& g = img_.geometry;
  const size_t esz = g.l2_entry_size();
  s.slice = plan.slices.size() - 1;
  s.index = static_cast<size_t>((s.gc % g.l2_entries()) % img_.l2_slice_entries());
  s.old_entry = plan.slices.back().be64(s.index * esz);
  s.old_bitmap = g.extended_l2 ? plan.slices.back().be64(s.index * esz + kExtendedL2BitmapOffset) : 0;
  return classify(s);
}

std::pair<GuestCluster, GuestCluster> Qcow2Writer::start_plan(GuestOffset guest, uint64_t len, Plan& plan) const {
  const Geometry& g = img_.geometry;
  plan.reset();
  const GuestCluster first_gc = guest >> g.cluster_bits, last_gc = (guest + len - 1) >> g.cluster_bits;
  plan.slots.reserve(static_cast<size_t>(last_gc - first_gc + 1));
  return {first_gc, last_gc};
}

// Pure overwrites need no metadata lock: the shared range lock keeps every
// mapping change of these clusters out (those hold it exclusive); an L1 entry
// another cluster's allocation sets meanwhile is read atomically
// (L1Table::load), and the L2 cache is internally synchronised.
Task<Result<bool>> Qcow2Writer::map_overwrite(GuestOffset guest, uint64_t len, Plan& plan) {
  const Geometry& g = img_.geometry;
  const auto [first_gc, last_gc] = start_plan(guest, len, plan);
  for (GuestCluster gc = first_gc; gc <= last_gc; ++gc) {
    Slot s = request_slot(gc, guest, len);
    const uint64_t l1_index = gc / g.l2_entries();
    const uint64_t e = l1_.load(static_cast<size_t>(l1_index));  // ensure_l2 may store it meanwhile
    auto l2 = l2_table_of(e, l1_index);
    if (!l2) co_return l2.status();
    if (*l2 == 0 || !(e & kOflagCopied)) co_return false;
    if (read_cached_entry(s, slice_of(s, *l2)))  // the common case: no task to await, no pin
      QCOWFS_CO_TRY(classify(s));
    else
      QCOWFS_CO_TRY(co_await load_entry(plan, s, *l2));
    if (s.kind != Kind::overwrite) co_return false;
    plan.slots.push_back(std::move(s));
  }
  co_return true;
}

Task<Status> Qcow2Writer::map_exclusive(GuestOffset guest, uint64_t len, Plan& plan) {
  const Geometry& g = img_.geometry;
  const auto [first_gc, last_gc] = start_plan(guest, len, plan);
  for (GuestCluster gc = first_gc; gc <= last_gc; ++gc) {
    Slot s = request_slot(gc, guest, len);
    auto l2 = co_await ensure_l2(gc / g.l2_entries());
    if (!l2) co_return l2.status();
    QCOWFS_CO_TRY(co_await load_entry(plan, s, *l2));
    plan.slots.push_back(std::move(s));
  }
  co_return Status::ok();
}

// Sets s.kind and the bytes written and mapped from its old L2 entry.
Status Qcow2Writer::classify(Slot& s) const {
  const Geometry& g = img_.geometry;
  auto c = classify_l2_entry(g, s.old_entry, s.old_bitmap);
  if (!c) {
    return corruption(fmt::format("L2 entry for guest offset {:#x}: {}", s.gc << g.cluster_bits,
                                  c.status().message()));
  }
  if (c->owned())
    classify_owned(s, c->host);
  else
    classify_allocate(s, c->allocated, c->kind == L2Kind::compressed);
  s.map_start = s.wr_start;
  s.map_end = s.wr_end;
  return Status::ok();
}

// An allocated COPIED cluster at `host`: overwrite when the touched
// subclusters are allocated, else update (written in place, entry changed).
void Qcow2Writer::classify_owned(Slot& s, HostOffset host) const {
  const Geometry& g = img_.geometry;
  const uint64_t scs = g.subcluster_size();
  const uint64_t first_sc = s.rq_start / scs, last_sc = (s.rq_end - 1) / scs;
  s.host = host;
  bool in_place;
  if (g.extended_l2) {
    const uint64_t mask = subcluster_mask(first_sc, last_sc);
    in_place = (s.old_bitmap & mask) == mask;
  } else {
    in_place = (s.old_entry & kOflagZero) == 0;
  }
  if (in_place) {
    s.kind = Kind::overwrite;
    s.wr_start = s.rq_start;
    s.wr_end = s.rq_end;
  } else {
    s.kind = Kind::update;
    s.wr_start = g.extended_l2 ? first_sc * scs : 0;
    s.wr_end = g.extended_l2 ? (last_sc + 1) * scs : g.cluster_size();
  }
}

// Anything else gets a new host cluster: whole, or (extended L2, nothing
// allocated before) only the touched subclusters.
void Qcow2Writer::classify_allocate(Slot& s, bool allocated, bool compressed) const {
  const Geometry& g = img_.geometry;
  const uint64_t scs = g.subcluster_size();
  const uint64_t first_sc = s.rq_start / scs, last_sc = (s.rq_end - 1) / scs;
  s.kind = Kind::allocate;
  const bool subclusters = g.extended_l2 && !allocated && !compressed;
  s.wr_start = subclusters ? first_sc * scs : 0;
  s.wr_end = subclusters ? (last_sc + 1) * scs : g.cluster_size();
  if (g.external_data) s.host = s.gc << g.cluster_bits;  // guest offset == host offset
}

// Idempotent: a plan that has its run keeps it (compress_and_allocate retries
// after growing the refcount table).
Task<Status> Qcow2Writer::allocate_run(Plan& plan) {
  if (img_.geometry.external_data || plan.run_clusters != 0) co_return Status::ok();
  uint64_t n = 0;
  for (const Slot& s : plan.slots) n += s.kind == Kind::allocate ? 1 : 0;
  if (n == 0) co_return Status::ok();
  // Clusters at or past the allocator's end have never been allocated in this
  // session and lie past the host file's end at open: they read as zeros.
  const HostCluster zero_from_hc = alloc_->end_cluster();
  auto first_hc = co_await alloc_->allocate(n);
  if (!first_hc) co_return first_hc.status();
  QCOWFS_CO_TRY(check_fresh(*first_hc, n));
  plan.first_hc = *first_hc;
  plan.run_clusters = n;
  HostCluster next_hc = *first_hc;
  bool partial_fresh = false;
  for (Slot& s : plan.slots) {
    if (s.kind != Kind::allocate) continue;
    // Host zeros decrypt to noise: an encrypted image writes whole clusters.
    if (!img_.crypt_file && next_hc >= zero_from_hc && old_reads_zero(s)) {
      write_only_request(s);
      partial_fresh = partial_fresh || s.wr_start != 0 || s.wr_end != img_.geometry.cluster_size();
    }
    s.host = (next_hc++) << img_.geometry.cluster_bits;
  }
  if (partial_fresh) QCOWFS_CO_TRY(co_await preallocate(zero_from_hc, *first_hc + n));
  co_return Status::ok();
}

Status Qcow2Writer::check_fresh(HostCluster first_hc, uint64_t n) const {
  const uint64_t cs = img_.geometry.cluster_size();
  const HostOffset start = first_hc * cs, end = (first_hc + n) * cs;
  auto overlaps = [&](HostOffset host, uint64_t len) { return len > 0 && host < end && start < host + len; };
  const Header& h = img_.header;
  if (overlaps(0, cs) || overlaps(l1_.host_offset, l1_.bytes()) ||
      overlaps(refcounts_->table_offset(), uint64_t{refcounts_->table_clusters()} * cs) ||
      overlaps(h.snapshots_offset, h.nb_snapshots ? cs : 0))
    return corruption(fmt::format("refcounts say host clusters {:#x}..{:#x} are free but metadata lives there",
                                  start, end - 1));
  return Status::ok();
}

// Whether the guest bytes [map_start, map_end) of an allocating slot read as
// zeros before this write (so a host cluster that reads as zeros needs no COW).
bool Qcow2Writer::old_reads_zero(const Slot& s) const {
  const Geometry& g = img_.geometry;
  const L2EntryClass c = decode_l2_entry(g, s.old_entry, s.old_bitmap);
  if (c.kind == L2Kind::compressed || c.host != 0) return false;
  if (!has_backing()) return true;  // unallocated and zero clusters alike
  if (!g.extended_l2) return c.kind == L2Kind::zero;
  const uint64_t scs = g.subcluster_size();
  const uint64_t zero_bits = subcluster_mask(s.map_start / scs, (s.map_end - 1) / scs) << kSubclusterZeroShift;
  return (s.old_bitmap & zero_bits) == zero_bits;
}

// A slot on a host cluster that reads as zeros and whose old contents are
// zeros: only the request goes to the host, padded to the host's alignment.
void Qcow2Writer::write_only_request(Slot& s) const {
  const uint64_t cs = img_.geometry.cluster_size();
  const uint64_t a = std::max<uint64_t>(img_.data_io->offset_align(), 1);
  s.fresh = true;
  s.wr_start = align_down(s.rq_start, a);
  s.wr_end = std::min(align_up(s.rq_end, a), cs);
}

// Small writes into fresh clusters would each extend the host file, and the
// host serialises extending (and hole-filling) writes. Allocate the host space
// ahead in kPreallocBytes steps instead (zero-reading extents past the file's
// end). Only clusters at or past zero_from_hc (never handed out, never written)
// are covered, so no data in flight is touched. Metadata lock held.
Task<Status> Qcow2Writer::preallocate(HostCluster zero_from_hc, HostCluster end_hc) {
  io::HostFile& f = *img_.file;
  const uint64_t bits = img_.geometry.cluster_bits;
  if (f.is_block_device() || (end_hc << bits) <= prealloc_end_) co_return Status::ok();
  const HostOffset from = std::max(zero_from_hc << bits, prealloc_end_);
  const HostOffset to = align_up((end_hc << bits) + kPreallocBytes, uint64_t{1} << bits);
  QCOWFS_CO_TRY(co_await f.write_zeroes(from, to - from));
  prealloc_end_ = to;
  co_return Status::ok();
}

// The preallocated space past the last allocated cluster goes at close.
Task<Status> Qcow2Writer::trim_preallocation() {
  io::HostFile& f = *img_.file;
  const HostOffset end = alloc_->end_cluster() << img_.geometry.cluster_bits;
  if (prealloc_end_ <= end || f.size() <= end) co_return Status::ok();
  QCOWFS_CO_TRY(co_await f.truncate(end));
  prealloc_end_ = end;
  co_return Status::ok();
}

// ---- L2 tables ----

Task<Result<TableCache::Ref>> Qcow2Writer::slice_for(HostOffset l2_table, uint64_t l2_index, size_t* index_in_slice) {
  const size_t per = img_.l2_slice_entries();
  *index_in_slice = static_cast<size_t>(l2_index % per);
  co_return co_await img_.l2_cache->get(l2_table + (l2_index / per) * img_.l2_cache->slice_size());
}

// The L2 table of L1 entry l1_index, owned by the active image (COPIED):
// a new zeroed table when there is none, a copy when it is shared with a
// snapshot (the old one's reference is dropped once the L1 change is on disk).
Task<Result<HostOffset>> Qcow2Writer::ensure_l2(uint64_t l1_index) {
  const uint64_t e = l1_.entries[l1_index];
  auto old_table = l2_table_of(e, l1_index);
  if (!old_table) co_return old_table.status();
  if (*old_table != 0 && (e & kOflagCopied)) co_return *old_table;
  auto hc = co_await alloc_->allocate(1);
  if (!hc) co_return hc.status();
  QCOWFS_CO_TRY(check_fresh(*hc, 1));
  const HostOffset new_table = *hc << img_.geometry.cluster_bits;
  if (Status st = co_await copy_l2_table(*old_table, new_table); !st) {
    (void)co_await alloc_->release(*hc, 1, nullptr);
    co_return st;
  }
  l1_.store(static_cast<size_t>(l1_index), new_table | kOflagCopied);  // read lock-free by map and reads
  tracker_.l1_changed(l1_index);
  if (*old_table != 0) tracker_.release_later(*old_table >> img_.geometry.cluster_bits, 1);
  co_return new_table;
}

// Writes the whole new L2 table at new_table: zeros, or old_table's contents.
Task<Status> Qcow2Writer::copy_l2_table(HostOffset old_table, HostOffset new_table) {
  const uint64_t cs = img_.geometry.cluster_size();
  io::AlignedBuffer table(static_cast<size_t>(cs), img_.file->mem_align(), true);
  if (old_table != 0) {  // shared with a snapshot: copy it
    auto n = co_await img_.file->read(old_table, table.span());
    if (!n) co_return n.status();
    if (*n != cs) co_return Status::errorf(EIO, "L2 table at {:#x} is truncated", old_table);
  }
  co_return co_await img_.file->write(new_table, table.span());
}

}  // namespace qcowfs::image::qcow2
