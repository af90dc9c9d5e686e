#include "image/qcow2/writer.h"

#include <algorithm>
#include <cstring>

#include "image/endian.h"
#include "image/qcow2/qcow2_check.h"
#include "image/qcow2/l2.h"
#include "io/align.h"
#include "io/log.h"
#include "io/when_all.h"

namespace qcowfs::image::qcow2 {
namespace {

constexpr uint64_t kZeroChunk = 1ull << 20;
constexpr uint64_t kAllSubclustersZero = kSubclusterAllocMask << kSubclusterZeroShift;

// Header field offsets written in place.
constexpr uint64_t kHeaderSizeOffset = 24;         // size .. l1_table_offset: 24 bytes
constexpr uint64_t kHeaderIncompatOffset = 72;

// Subcluster bits [first, last] of an extended L2 bitmap.
uint64_t subcluster_mask(uint64_t first, uint64_t last) {
  uint64_t n = last - first + 1;
  return (n >= 64 ? ~uint64_t{0} : ((uint64_t{1} << n) - 1)) << first;
}

}  // namespace

// One guest cluster of a request.
struct Qcow2Writer::Slot {
  uint64_t cluster = 0;  // guest cluster index
  Kind kind = Kind::overwrite;
  uint64_t old_entry = 0, old_bitmap = 0;
  uint64_t host = 0;                  // host cluster offset (existing or new)
  uint64_t wr_start = 0, wr_end = 0;  // bytes of the cluster written to the host
  uint64_t map_start = 0, map_end = 0;  // bytes the new L2 entry maps (from classify)
  bool fresh = false;                 // host cluster known to read as zeros: no COW read
  uint64_t rq_start = 0, rq_end = 0;  // bytes of the cluster the request covers
  size_t slice = 0;                   // index into Plan::slices
  size_t index = 0;                   // entry index inside that slice
  io::AlignedBuffer cow;              // [wr_start, wr_end) when it is wider than the request
                                      // (fresh: the request padded with zeros to the host alignment)
  bool needs_cow() const { return wr_start != rq_start || wr_end != rq_end; }
};

struct Qcow2Writer::Plan {
  std::vector<Slot> slots;
  std::vector<L2Cache::Ref> slices;
  uint64_t run_first = 0, run_count = 0;  // host clusters allocated for this request
  bool needs_exclusive = false;
};

Qcow2Writer::Qcow2Writer(Qcow2Image& image, L1Table& l1, ReadFn read_old, bool discard_unmap)
    : img_(image), l1_(l1), read_old_(std::move(read_old)), discard_unmap_(discard_unmap), size_(image.header.size) {}

Task<Result<std::unique_ptr<Qcow2Writer>>> Qcow2Writer::open(Qcow2Image& image, L1Table& l1, ReadFn read_old,
                                                             const ImageOptions& opts) {
  auto w = std::make_unique<Qcow2Writer>(image, l1, std::move(read_old), opts.discard_unmap);
  if (image.header.dirty()) QCOWFS_CO_TRY(co_await w->repair_refcounts());
  const Header& h = image.header;
  size_t cache_blocks = std::max<size_t>(16, static_cast<size_t>((4ull << 20) >> h.cluster_bits));
  auto rt = co_await RefcountTable::load(*image.file, h.cluster_bits, h.refcount_order, h.refcount_table_offset,
                                         h.refcount_table_clusters, cache_blocks);
  if (!rt) co_return rt.status();
  w->refcounts_ = std::move(*rt);
  auto used = co_await w->refcounts_->end_of_used();
  if (!used) co_return used.status();
  uint64_t end = std::max(div_round_up(image.file->size(), h.cluster_size()), *used);
  w->alloc_ = std::make_unique<ClusterAllocator>(*w->refcounts_, end);
  w->alloc_->set_hint(0);
  co_return w;
}

bool Qcow2Writer::has_backing() const { return img_.backing != nullptr; }

// ---- header ----

Task<Status> Qcow2Writer::write_header_bytes(uint64_t off, std::span<const std::byte> bytes) {
  QCOWFS_CO_TRY(co_await img_.file->write(bytes, off));
  co_return co_await img_.file->flush();
}

Task<Status> Qcow2Writer::set_incompatible_bits(uint64_t bits) {
  std::byte b[8];
  store_be64(b, bits);
  QCOWFS_CO_TRY(co_await write_header_bytes(kHeaderIncompatOffset, b));
  img_.header.incompatible_features = bits;
  co_return Status::ok();
}

// A dirty image's refcounts are not trusted: as QEMU does when it opens one
// read-write, every refcount is recounted from the metadata (image/qcow2/qcow2_check.h:
// everything qemu-img check counts, bitmaps included) into a fresh refcount
// structure, then the dirty bit is cleared. Unlike QEMU, metadata the walk
// finds corrupt fails the open (EIO) instead of being written around. Runs before the refcounts are
// loaded; the metadata layout is taken again, since the old refcount blocks
// are free space now.
Task<Status> Qcow2Writer::repair_refcounts() {
  log::info("{}: image was not closed cleanly: rebuilding refcounts before writing", img_.path);
  QCOWFS_CO_TRY(co_await rebuild_refcounts(*img_.file, img_.header, OnCorruption::refuse));
  auto layout = co_await build_metadata_layout(*img_.file, img_.header, l1_.entries, img_.snapshots);
  if (!layout) co_return co_await signal_corruption(img_, layout.status().message());
  img_.layout = std::move(*layout);
  co_return co_await set_incompatible_bits(img_.header.incompatible_features & ~kIncompatDirty);
}

// Autoclear bits this writer does not maintain are cleared before the first
// change, as the qcow2 spec asks of a program that does not know them. For
// the bitmaps bit that invalidates every persistent bitmap; QEMU then drops
// the bitmaps extension from the header, and so does this one header write.
// The clusters the bitmaps held (directory, tables, data) are freed after it,
// where QEMU would leave them leaked until `qemu-img check -r`. Metadata lock held.
Task<Status> Qcow2Writer::clear_autoclear_features() {
  Header& h = img_.header;
  auto held = co_await bitmaps_extension_ranges(*img_.file, h);
  if (!held) co_return held.status();
  Header next = h;
  next.autoclear_features &= kAutoclearDataFileRaw;
  next.bitmaps.reset();
  auto bytes = serialize_header(next);
  if (!bytes) co_return bytes.status();
  QCOWFS_CO_TRY(co_await write_header_bytes(0, *bytes));
  log::info("{}: cleared autoclear feature bits {:#x} (not maintained by this writer){}", img_.path,
            h.autoclear_features & ~next.autoclear_features, h.bitmaps ? ", persistent bitmaps dropped" : "");
  h = std::move(next);
  const uint32_t bits = img_.geometry.cluster_bits;
  for (const HostRange& r : *held) {
    if (r.length == 0) continue;
    const uint64_t first = r.offset >> bits, last = (r.offset + r.length - 1) >> bits;
    QCOWFS_CO_TRY(co_await alloc_->release(first, last - first + 1, nullptr));
  }
  co_return Status::ok();
}

// Before the first change: clear autoclear bits we do not maintain and, with
// lazy refcounts, set the dirty bit (each one header write + flush).
Task<Status> Qcow2Writer::prepare() {
  if (prepared_.load(std::memory_order_acquire)) co_return Status::ok();
  auto m = co_await meta_.lock();
  if (prepared_) co_return Status::ok();
  Header& h = img_.header;
  if (h.version >= 3) {
    if ((h.autoclear_features & ~kAutoclearDataFileRaw) != 0 || h.bitmaps) QCOWFS_CO_TRY(co_await clear_autoclear_features());
    if ((h.compatible_features & kCompatLazyRefcounts) && !h.dirty()) {
      QCOWFS_CO_TRY(co_await set_incompatible_bits(h.incompatible_features | kIncompatDirty));
      set_dirty_bit_ = true;
    }
  }
  prepared_.store(true, std::memory_order_release);
  co_return Status::ok();
}

// ---- mapping ----

Task<Result<L2Cache::Ref>> Qcow2Writer::slice_for(uint64_t l2_offset, uint64_t l2_index, size_t* index_in_slice) {
  size_t per = img_.l2_slice_entries();
  *index_in_slice = static_cast<size_t>(l2_index % per);
  co_return co_await img_.l2_cache->get(l2_offset + (l2_index / per) * img_.l2_cache->slice_size());
}

Task<Result<uint64_t>> Qcow2Writer::ensure_l2(uint64_t l1_index) {
  const uint64_t e = l1_.entries[l1_index];
  auto decoded = decode_l1_entry(img_.geometry, e);
  if (!decoded) co_return corruption(fmt::format("L1 entry {}: {}", l1_index, decoded.status().message()));
  const uint64_t old = *decoded;
  if (old != 0 && (e & kOflagCopied)) co_return old;
  const uint64_t cs = img_.geometry.cluster_size();
  auto c = co_await alloc_->allocate(1);
  if (!c) co_return c.status();
  QCOWFS_CO_TRY(check_fresh(*c, 1));
  uint64_t fresh = *c << img_.geometry.cluster_bits;
  io::AlignedBuffer table(static_cast<size_t>(cs), img_.file->mem_align(), true);
  Status st;
  if (old != 0) {  // shared with a snapshot: copy it
    auto n = co_await img_.file->read(table.span(), old);
    if (!n) st = n.status();
    else if (*n != cs) st = Status::errorf(EIO, "L2 table at {:#x} is truncated", old);
  }
  if (st) st = co_await img_.file->write(table.span(), fresh);
  if (!st) {
    (void)co_await alloc_->release(*c, 1, nullptr);
    co_return st;
  }
  l1_.store(static_cast<size_t>(l1_index), fresh | kOflagCopied);  // read lock-free by map() and reads
  tracker_.l1_changed(l1_index);
  if (old != 0) tracker_.release_later(old >> img_.geometry.cluster_bits, 1);
  co_return fresh;
}

Task<Status> Qcow2Writer::classify(Slot& s, bool exclusive) {
  const Geometry& g = img_.geometry;
  const uint64_t cs = g.cluster_size();
  const uint64_t entry = s.old_entry, bitmap = s.old_bitmap;
  auto check = decode_cluster_run(g, entry, bitmap, 0, cs);
  if (!check) {
    co_return corruption(fmt::format("L2 entry for guest offset {:#x}: {}", s.cluster << g.cluster_bits,
                                     check.status().message()));
  }
  const bool compressed = (entry & kOflagCompressed) != 0;
  const uint64_t host = compressed ? 0 : entry & kL2OffsetMask;
  const bool allocated = !compressed && (host != 0 || (g.external_data && (entry & kOflagCopied)));
  const uint64_t scs = g.subcluster_size();
  const uint64_t sc_first = s.rq_start / scs, sc_last = (s.rq_end - 1) / scs;
  if (allocated && (entry & kOflagCopied)) {
    s.host = host;
    bool in_place;
    if (g.extended_l2) {
      uint64_t mask = subcluster_mask(sc_first, sc_last);
      in_place = (bitmap & mask) == mask;
    } else {
      in_place = (entry & kOflagZero) == 0;
    }
    if (in_place) {
      s.kind = Kind::overwrite;
      s.wr_start = s.rq_start;
      s.wr_end = s.rq_end;
    } else {
      s.kind = Kind::update;
      s.wr_start = g.extended_l2 ? sc_first * scs : 0;
      s.wr_end = g.extended_l2 ? (sc_last + 1) * scs : cs;
    }
  } else {
    s.kind = Kind::allocate;
    bool subclusters = g.extended_l2 && !allocated && !compressed;
    s.wr_start = subclusters ? sc_first * scs : 0;
    s.wr_end = subclusters ? (sc_last + 1) * scs : cs;
    if (g.external_data) s.host = s.cluster << g.cluster_bits;  // guest offset == host offset
  }
  s.map_start = s.wr_start;
  s.map_end = s.wr_end;
  (void)exclusive;
  co_return Status::ok();
}

Task<Status> Qcow2Writer::map(uint64_t off, uint64_t len, bool exclusive, Plan& plan) {
  const Geometry& g = img_.geometry;
  const uint64_t cs = g.cluster_size(), l2_entries = g.l2_entries();
  const size_t esz = g.l2_entry_size();
  plan = Plan{};
  const uint64_t first = off >> g.cluster_bits, last = (off + len - 1) >> g.cluster_bits;
  plan.slots.reserve(static_cast<size_t>(last - first + 1));
  for (uint64_t c = first; c <= last; ++c) {
    Slot s;
    s.cluster = c;
    s.rq_start = c == first ? off & (cs - 1) : 0;
    s.rq_end = c == last ? ((off + len - 1) & (cs - 1)) + 1 : cs;
    uint64_t l1_index = c / l2_entries;
    uint64_t l2;
    if (exclusive) {
      auto r = co_await ensure_l2(l1_index);
      if (!r) co_return r.status();
      l2 = *r;
    } else {
      uint64_t e = l1_.load(static_cast<size_t>(l1_index));  // ensure_l2 may store it meanwhile
      auto decoded = decode_l1_entry(g, e);
      if (!decoded) co_return corruption(fmt::format("L1 entry {}: {}", l1_index, decoded.status().message()));
      l2 = *decoded;
      if (l2 == 0 || !(e & kOflagCopied)) {
        plan.needs_exclusive = true;
        co_return Status::ok();
      }
    }
    size_t per = img_.l2_slice_entries();
    uint64_t slice_off = l2 + ((c % l2_entries) / per) * img_.l2_cache->slice_size();
    if (plan.slices.empty() || plan.slices.back().host_offset() != slice_off) {
      auto ref = co_await img_.l2_cache->get(slice_off);
      if (!ref) co_return ref.status().with_context(fmt::format("guest offset {:#x}", c << g.cluster_bits));
      plan.slices.push_back(std::move(*ref));
    }
    s.slice = plan.slices.size() - 1;
    s.index = static_cast<size_t>((c % l2_entries) % per);
    s.old_entry = plan.slices.back().entry(s.index, esz);
    s.old_bitmap = g.extended_l2 ? plan.slices.back().bitmap(s.index, esz) : 0;
    QCOWFS_CO_TRY(co_await classify(s, exclusive));
    if (!exclusive && s.kind != Kind::overwrite) {
      plan.needs_exclusive = true;
      co_return Status::ok();
    }
    plan.slots.push_back(std::move(s));
  }
  co_return Status::ok();
}

Task<Status> Qcow2Writer::allocate_run(Plan& plan) {
  if (img_.geometry.external_data) co_return Status::ok();
  uint64_t n = 0;
  for (const Slot& s : plan.slots) n += s.kind == Kind::allocate ? 1 : 0;
  if (n == 0) co_return Status::ok();
  // Clusters at or past the allocator's end have never been allocated in this
  // session and lie past the host file's end at open: they read as zeros.
  const uint64_t zero_from = alloc_->end_cluster();
  auto first = co_await alloc_->allocate(n);
  if (!first) co_return first.status();
  QCOWFS_CO_TRY(check_fresh(*first, n));
  plan.run_first = *first;
  plan.run_count = n;
  uint64_t next = *first;
  bool partial_fresh = false;
  for (Slot& s : plan.slots) {
    if (s.kind != Kind::allocate) continue;
    if (next >= zero_from && old_reads_zero(s)) {
      write_only_request(s);
      partial_fresh = partial_fresh || s.wr_start != 0 || s.wr_end != img_.geometry.cluster_size();
    }
    s.host = (next++) << img_.geometry.cluster_bits;
  }
  if (partial_fresh) QCOWFS_CO_TRY(co_await preallocate(zero_from, *first + n));
  co_return Status::ok();
}

// Small writes into fresh clusters would each extend the host file, and the
// host serialises extending (and hole-filling) writes. Allocate the host space
// ahead in kPreallocBytes steps instead (zero-reading extents past the file's
// end). Only clusters at or past zero_from (never handed out, never written)
// are covered, so no data in flight is touched. Metadata lock held.
Task<Status> Qcow2Writer::preallocate(uint64_t zero_from, uint64_t run_end) {
  io::HostFile& f = *img_.file;
  const uint64_t bits = img_.geometry.cluster_bits;
  if (f.is_block_device() || (run_end << bits) <= prealloc_end_) co_return Status::ok();
  const uint64_t from = std::max(zero_from << bits, prealloc_end_);
  const uint64_t to = align_up((run_end << bits) + kPreallocBytes, uint64_t{1} << bits);
  QCOWFS_CO_TRY(co_await f.write_zeroes(from, to - from));
  prealloc_end_ = to;
  co_return Status::ok();
}

// The preallocated space past the last allocated cluster goes at close.
Task<Status> Qcow2Writer::trim_preallocation() {
  io::HostFile& f = *img_.file;
  const uint64_t end = alloc_->end_cluster() << img_.geometry.cluster_bits;
  if (prealloc_end_ <= end || f.size() <= end) co_return Status::ok();
  QCOWFS_CO_TRY(co_await f.truncate(end));
  prealloc_end_ = end;
  co_return Status::ok();
}

// Whether the guest bytes [map_start, map_end) of an allocating slot read as
// zeros before this write (so a host cluster that reads as zeros needs no COW).
bool Qcow2Writer::old_reads_zero(const Slot& s) const {
  const Geometry& g = img_.geometry;
  if ((s.old_entry & kOflagCompressed) || (s.old_entry & kL2OffsetMask) != 0) return false;
  if (!has_backing()) return true;  // unallocated and zero clusters alike
  if (!g.extended_l2) return (s.old_entry & kOflagZero) != 0;
  const uint64_t scs = g.subcluster_size();
  const uint64_t zero_bits = subcluster_mask(s.map_start / scs, (s.map_end - 1) / scs) << kSubclusterZeroShift;
  return (s.old_bitmap & zero_bits) == zero_bits;
}

// A slot on a host cluster that reads as zeros and whose old contents are
// zeros: only the request goes to the host, padded to the host's alignment.
void Qcow2Writer::write_only_request(Slot& s) const {
  const uint64_t cs = img_.geometry.cluster_size();
  const uint64_t a = std::max<uint64_t>(img_.data_file->offset_align(), 1);
  s.fresh = true;
  s.wr_start = align_down(s.rq_start, a);
  s.wr_end = std::min(align_up(s.rq_end, a), cs);
}

// ---- data ----

Task<Status> Qcow2Writer::fill_cow(Plan& plan, uint64_t off, std::span<const std::byte> buf) {
  const uint64_t cs = img_.geometry.cluster_size();
  const uint64_t disk = size();
  for (Slot& s : plan.slots) {
    if (s.kind == Kind::overwrite || !s.needs_cow()) continue;
    s.cow = io::AlignedBuffer(static_cast<size_t>(s.wr_end - s.wr_start), img_.data_file->mem_align(), true);
    uint64_t guest = s.cluster * cs + s.wr_start;
    uint64_t n = guest < disk && !s.fresh ? std::min(s.wr_end - s.wr_start, disk - guest) : 0;
    if (n > 0) QCOWFS_CO_TRY(co_await read_old_(guest, s.cow.span().first(static_cast<size_t>(n))));
    std::memcpy(s.cow.data() + (s.rq_start - s.wr_start), buf.data() + (s.cluster * cs + s.rq_start - off),
                static_cast<size_t>(s.rq_end - s.rq_start));
  }
  co_return Status::ok();
}

// QEMU's overlap check: guest data must never land on metadata. Returns the
// metadata range [host, host + len) overlaps, or null.
const MetadataRange* Qcow2Writer::data_overlap(uint64_t host, uint64_t len) const {
  if (img_.data_file != img_.file.get()) return nullptr;
  const MetadataRange* m = img_.layout.overlap(host, len);
  // The layout is taken at open; the writer moves the L1 and refcount
  // tables when they grow and frees the old ones, which may then hold data.
  // Called without the metadata lock (pure overwrites never take it). The L1
  // table moves only with the whole guest range locked exclusive, which our
  // range lock excludes; the refcount table moves under the metadata lock
  // alone, so its offset is an atomic (RefcountTable::table_offset): a reused
  // old-table cluster was handed out after the move was published.
  if (m && ((m->what == "L1 table" && m->start != l1_.host_offset) ||
            (m->what == "refcount table" && m->start != refcounts_->table_offset())))
    return nullptr;
  return m;
}

Task<Status> Qcow2Writer::data_overlap_error(uint64_t off, uint64_t host, const MetadataRange& m) {
  co_return co_await signal_corruption(
      img_, fmt::format("guest write at {:#x} maps to host {:#x}, inside the {} at {:#x}", off, host, m.what, m.start));
}

Task<Status> Qcow2Writer::write_data(Plan& plan, uint64_t off, std::span<const std::byte> buf) {
  const uint64_t cs = img_.geometry.cluster_size();
  if (plan.slots.size() == 1 && plan.slots[0].cow.empty()) {  // the common small write: no vectors
    const Slot& s = plan.slots[0];
    const uint64_t host = s.host + s.wr_start;
    if (const MetadataRange* m = data_overlap(host, s.rq_end - s.rq_start)) co_return co_await data_overlap_error(off, host, *m);
    co_return co_await img_.data_file->write(buf, host);
  }
  struct HostRun {
    uint64_t host = 0, len = 0;
    std::vector<iovec> iov;
  };
  std::vector<HostRun> runs;
  for (Slot& s : plan.slots) {
    iovec v;
    if (s.cow.empty()) {
      v.iov_base = const_cast<std::byte*>(buf.data() + (s.cluster * cs + s.rq_start - off));
      v.iov_len = static_cast<size_t>(s.rq_end - s.rq_start);
    } else {
      v.iov_base = s.cow.data();
      v.iov_len = s.cow.size();
    }
    uint64_t host = s.host + s.wr_start;
    if (!runs.empty() && runs.back().host + runs.back().len == host) {
      HostRun& r = runs.back();
      iovec& prev = r.iov.back();
      if (static_cast<std::byte*>(prev.iov_base) + prev.iov_len == static_cast<std::byte*>(v.iov_base))
        prev.iov_len += v.iov_len;
      else
        r.iov.push_back(v);
      r.len += v.iov_len;
    } else {
      runs.push_back(HostRun{host, v.iov_len, {v}});
    }
  }
  io::HostFile& f = *img_.data_file;
  for (const HostRun& r : runs)
    if (const MetadataRange* m = data_overlap(r.host, r.len)) co_return co_await data_overlap_error(off, r.host, *m);
  std::vector<Task<Status>> writes;
  writes.reserve(runs.size());
  for (HostRun& r : runs) {
    if (r.iov.size() == 1)
      writes.push_back(f.write(std::span<const std::byte>(static_cast<const std::byte*>(r.iov[0].iov_base), r.len), r.host));
    else
      writes.push_back(f.writev(r.iov, r.host));
  }
  co_return co_await io::when_all(std::move(writes));
}

// ---- metadata updates (metadata lock held) ----

Task<Status> Qcow2Writer::set_l2(L2Cache::Ref& slice, size_t index, uint64_t entry, uint64_t bitmap) {
  const size_t esz = img_.geometry.l2_entry_size();
  std::byte* p = slice.mutable_bytes().data() + index * esz;
  store_be64(p, entry);
  if (img_.geometry.extended_l2) store_be64(p + 8, bitmap);
  if (!tracker_.touch_l2(slice.host_offset())) {
    auto ref = co_await img_.l2_cache->get(slice.host_offset());
    if (!ref) co_return ref.status();
    tracker_.add_l2(std::move(*ref), *img_.l2_cache);
  }
  co_return Status::ok();
}

void Qcow2Writer::release_old(uint64_t entry) {
  const Geometry& g = img_.geometry;
  if (entry & kOflagCompressed) {
    CompressedCluster c = decode_compressed(g.cluster_bits, entry);
    uint64_t start = align_down(c.host_offset, kCompressedSectorSize);
    uint64_t end = c.host_offset + c.size;  // sector aligned
    uint64_t first = start >> g.cluster_bits, last = (end - 1) >> g.cluster_bits;
    tracker_.release_later(first, last - first + 1);
    img_.cluster_cache->erase(c.host_offset);
    return;
  }
  uint64_t host = entry & kL2OffsetMask;
  if (host != 0 && !g.external_data) tracker_.release_later(host >> g.cluster_bits, 1);
}

Task<Status> Qcow2Writer::commit(Plan& plan) {
  const Geometry& g = img_.geometry;
  const uint64_t scs = g.subcluster_size();
  for (Slot& s : plan.slots) {
    if (s.kind == Kind::overwrite) continue;
    uint64_t bitmap = 0;
    if (g.extended_l2) {
      // A whole-cluster write holds the complete contents (old ones copied in):
      // every subcluster is allocated. Otherwise the written subclusters become
      // allocated and the others keep their state.
      uint64_t mask = subcluster_mask(s.map_start / scs, (s.map_end - 1) / scs);
      bool whole = s.map_start == 0 && s.map_end == g.cluster_size();
      bitmap = whole ? kSubclusterAllocMask : (s.old_bitmap | mask) & ~(mask << kSubclusterZeroShift);
    }
    QCOWFS_CO_TRY(co_await set_l2(plan.slices[s.slice], s.index, s.host | kOflagCopied, bitmap));
    if (s.kind == Kind::allocate) release_old(s.old_entry);
  }
  note_dirty_amount();
  co_return Status::ok();
}

Task<Status> Qcow2Writer::undo(Plan& plan) {
  if (plan.run_count == 0) co_return Status::ok();
  co_return co_await alloc_->release(plan.run_first, plan.run_count, nullptr);
}

// ---- write ----

Task<Status> Qcow2Writer::write_once(uint64_t off, std::span<const std::byte> buf, bool exclusive,
                                     bool* retry_exclusive) {
  const uint64_t cs = img_.geometry.cluster_size();
  auto range = co_await ranges_.lock(align_down(off, cs), align_up(off + buf.size(), cs),
                                     exclusive ? io::RangeLock::Mode::exclusive : io::RangeLock::Mode::shared);
  Plan plan;
  if (!exclusive) {
    // Pure overwrites need no metadata lock: the shared range lock keeps every
    // mapping change of these clusters out (those hold it exclusive); an L1
    // entry another cluster's allocation sets meanwhile is read atomically
    // (L1Table::load), only the refcount table offset of the overlap check
    // moves under the metadata lock alone (an atomic, see data_overlap), and
    // the L2 cache is internally synchronised.
    QCOWFS_CO_TRY(co_await map(off, buf.size(), false, plan));
    if (plan.needs_exclusive) {
      *retry_exclusive = true;
      co_return Status::ok();
    }
    co_return co_await write_data(plan, off, buf);
  }
  {
    auto m = co_await meta_.lock();
    auto map_and_allocate = [&]() -> Task<Status> {
      QCOWFS_CO_TRY(co_await map(off, buf.size(), exclusive, plan));
      co_return co_await allocate_run(plan);
    };
    QCOWFS_CO_TRY(co_await with_refcount_room(m, map_and_allocate));
    if (plan.needs_exclusive) {
      *retry_exclusive = true;
      co_return Status::ok();
    }
  }
  Status st = co_await fill_cow(plan, off, buf);
  if (st) st = co_await write_data(plan, off, buf);
  auto m = co_await meta_.lock();
  tracker_.data_written();
  if (!st) {
    Status u = co_await undo(plan);
    if (!u) log::error("{}: releasing clusters of a failed write: {}", img_.path, u.message());
    co_return st;
  }
  co_return co_await commit(plan);
}

Task<Status> Qcow2Writer::write(uint64_t off, std::span<const std::byte> buf) {
  if (buf.empty()) co_return Status::ok();
  if (marked_corrupt_) co_return corrupt_error();
  QCOWFS_CO_TRY(co_await prepare());
  bool retry = false;
  QCOWFS_CO_TRY(co_await check_corruption(co_await write_once(off, buf, false, &retry)));
  if (retry) {
    bool again = false;
    QCOWFS_CO_TRY(co_await check_corruption(co_await write_once(off, buf, true, &again)));
  }
  co_return co_await check_corruption(co_await maybe_writeback());
}

Status Qcow2Writer::corruption(std::string what) {
  corruption_seen_ = true;
  log::error("{}: corrupt qcow2 metadata: {}", img_.path, what);
  return Status::errorf(EIO, "corrupt qcow2 metadata: {}", what);
}

Status Qcow2Writer::check_fresh(uint64_t first_cluster, uint64_t n) {
  const uint64_t cs = img_.geometry.cluster_size();
  const uint64_t start = first_cluster * cs, end = (first_cluster + n) * cs;
  auto overlaps = [&](uint64_t off, uint64_t len) { return len > 0 && off < end && start < off + len; };
  const Header& h = img_.header;
  if (overlaps(0, cs) || overlaps(l1_.host_offset, l1_.entries.size() * 8) ||
      overlaps(refcounts_->table_offset(), uint64_t{refcounts_->table_clusters()} * cs) ||
      overlaps(h.snapshots_offset, h.nb_snapshots ? cs : 0))
    return corruption(fmt::format("refcounts say host clusters {:#x}..{:#x} are free but metadata lives there",
                                  start, end - 1));
  return Status::ok();
}

Status Qcow2Writer::corrupt_error() const {
  return Status::error(EIO, "the qcow2 image was marked corrupt: only reads are allowed");
}

Task<Status> Qcow2Writer::check_corruption(Status st) {
  if (st) co_return st;
  bool seen;
  {
    auto m = co_await meta_.lock();
    seen = corruption_seen_ || refcounts_->corruption_found();
  }
  if (!seen || marked_corrupt_.exchange(true)) co_return st;
  log::error("{}: marking the image corrupt (incompatible feature bit 1); further writes fail with EIO", img_.path);
  Status mark = co_await set_incompatible_bits(img_.header.incompatible_features | kIncompatCorrupt);
  if (!mark) log::error("{}: could not set the corrupt bit: {}", img_.path, mark.message());
  co_return Status::error(EIO, st.message());
}

// ---- discard / zeroes ----

Task<Status> Qcow2Writer::zero_clusters(uint64_t first, uint64_t end, ZeroMode mode, std::vector<uint64_t>* need_data) {
  const Geometry& g = img_.geometry;
  const uint64_t l2_entries = g.l2_entries();
  const bool v3 = img_.header.version >= 3;
  const bool backing = has_backing();
  for (uint64_t c = first; c < end; ++c) {
    uint64_t l1_index = c / l2_entries;
    uint64_t l1e = l1_.entries[l1_index];
    if ((l1e & kL1OffsetMask) == 0 && !backing) {  // the whole L2 range reads as zeros
      c = (l1_index + 1) * l2_entries - 1;
      continue;
    }
    if (!v3 && backing) {  // v2 cannot hide the backing file without data
      if (mode != ZeroMode::discard) need_data->push_back(c);
      continue;
    }
    auto l2 = co_await ensure_l2(l1_index);
    if (!l2) co_return l2.status();
    size_t index = 0;
    auto slice = co_await slice_for(*l2, c % l2_entries, &index);
    if (!slice) co_return slice.status();
    const size_t esz = g.l2_entry_size();
    uint64_t entry = slice->entry(index, esz);
    uint64_t bitmap = g.extended_l2 ? slice->bitmap(index, esz) : 0;
    Slot probe;
    probe.cluster = c;
    probe.old_entry = entry;
    probe.old_bitmap = bitmap;
    probe.rq_start = 0;
    probe.rq_end = g.cluster_size();
    QCOWFS_CO_TRY(co_await classify(probe, true));
    bool owned = probe.kind != Kind::allocate && !(entry & kOflagCompressed);  // allocated and COPIED
    uint64_t new_entry = 0, new_bitmap = 0;
    bool release = (entry & (kOflagCompressed | kL2OffsetMask)) != 0;
    if (mode == ZeroMode::zero_keep && owned) {
      if (!v3) {
        need_data->push_back(c);
        continue;
      }
      new_entry = (entry & kL2OffsetMask) | kOflagCopied | (g.extended_l2 ? 0 : kOflagZero);
      new_bitmap = kAllSubclustersZero;
      release = false;
    } else if (!backing) {
      new_entry = 0;  // unallocated reads as zeros
    } else {
      new_entry = g.extended_l2 ? 0 : kOflagZero;
      new_bitmap = kAllSubclustersZero;
    }
    if (!g.extended_l2) new_bitmap = 0;
    if (new_entry == entry && new_bitmap == bitmap) continue;
    QCOWFS_CO_TRY(co_await set_l2(*slice, index, new_entry, new_bitmap));
    if (release) release_old(entry);
  }
  co_return Status::ok();
}

Task<Status> Qcow2Writer::write_zero_bytes(uint64_t off, uint64_t len) {
  io::AlignedBuffer zeros(static_cast<size_t>(std::min(len, kZeroChunk)), img_.data_file->mem_align(), true);
  while (len > 0) {
    uint64_t n = std::min(len, kZeroChunk);
    QCOWFS_CO_TRY(co_await write(off, zeros.span().first(static_cast<size_t>(n))));
    off += n;
    len -= n;
  }
  co_return Status::ok();
}

Task<Status> Qcow2Writer::zero_range(uint64_t off, uint64_t len, ZeroMode mode) {
  if (len == 0) co_return Status::ok();
  if (marked_corrupt_) co_return corrupt_error();
  QCOWFS_CO_TRY(co_await prepare());
  const Geometry& g = img_.geometry;
  const uint64_t cs = g.cluster_size(), end = off + len;
  const uint64_t a = align_up(off, cs);
  const uint64_t b = end >= size() ? align_up(end, cs) : align_down(end, cs);
  const bool write_partial = mode != ZeroMode::discard;
  if (a >= b) {
    if (write_partial) QCOWFS_CO_TRY(co_await write_zero_bytes(off, len));
    co_return Status::ok();
  }
  if (write_partial && off < a) QCOWFS_CO_TRY(co_await write_zero_bytes(off, a - off));
  if (write_partial && b < end) QCOWFS_CO_TRY(co_await write_zero_bytes(b, end - b));
  std::vector<uint64_t> need_data;
  {
    auto range = co_await ranges_.lock(a, b, io::RangeLock::Mode::exclusive);
    // data_file_raw: the data file alone must read as the guest disk, so it
    // is zeroed first, as QEMU does, whatever the L2 entries will say.
    if (img_.header.data_file_raw())
      QCOWFS_CO_TRY(co_await img_.data_file->write_zeroes(a, std::min(b, size()) - a));
    auto m = co_await meta_.lock();
    auto zero = [&]() -> Task<Status> {
      need_data.clear();
      co_return co_await zero_clusters(a >> g.cluster_bits, b >> g.cluster_bits, mode, &need_data);
    };
    QCOWFS_CO_TRY(co_await with_refcount_room(m, zero));
    note_dirty_amount();
  }
  for (size_t i = 0; i < need_data.size();) {
    size_t j = i + 1;
    while (j < need_data.size() && need_data[j] == need_data[j - 1] + 1) ++j;
    uint64_t start = need_data[i] << g.cluster_bits;
    uint64_t stop = std::min((need_data[j - 1] + 1) << g.cluster_bits, size());
    QCOWFS_CO_TRY(co_await write_zero_bytes(start, stop - start));
    i = j;
  }
  co_return co_await maybe_writeback();
}

Task<Status> Qcow2Writer::discard(uint64_t off, uint64_t len) { co_return co_await zero_range(off, len, ZeroMode::discard); }

Task<Status> Qcow2Writer::write_zeroes(uint64_t off, uint64_t len, bool may_unmap) {
  co_return co_await zero_range(off, len, may_unmap ? ZeroMode::zero_unmap : ZeroMode::zero_keep);
}

// ---- writeback ----

Task<Status> Qcow2Writer::writeback() {
  auto wb = co_await writeback_lock_.lock();
  co_return co_await writeback_locked();
}

Task<Status> Qcow2Writer::writeback_locked() {
  WritebackBatch batch;
  {
    auto m = co_await meta_.lock();
    batch = tracker_.take(*refcounts_, l1_.entries, l1_.host_offset);
  }
  Status st = co_await write_batch(*img_.file, *img_.data_file, batch);
  auto m = co_await meta_.lock();
  if (!st) {
    tracker_.failed(batch);
    co_return st;
  }
  tracker_.written(batch, *refcounts_, *img_.l2_cache);
  std::vector<uint64_t> freed;
  for (const DeferredRelease& r : batch.releases) {
    Status rs = co_await alloc_->release(r.first_cluster, r.count, discard_unmap_ ? &freed : nullptr);
    if (!rs) {
      log::error("{}: dropping references to host clusters {:#x}+{}: {}", img_.path, r.first_cluster, r.count,
                 rs.message());
      co_return rs;
    }
  }
  // Freed clusters cannot be reused before this lock is released: punch them now.
  std::sort(freed.begin(), freed.end());
  const uint32_t bits = img_.geometry.cluster_bits;
  for (size_t i = 0; i < freed.size();) {
    size_t j = i + 1;
    while (j < freed.size() && freed[j] == freed[j - 1] + 1) ++j;
    Status ds = co_await img_.file->discard(freed[i] << bits, (freed[j - 1] - freed[i] + 1) << bits);
    if (!ds) log::warn("{}: discarding freed host clusters at {:#x}: {}", img_.path, freed[i] << bits, ds.message());
    i = j;
  }
  co_return Status::ok();
}

void Qcow2Writer::note_dirty_amount() {
  if (tracker_.dirty_l2_slices() > kMaxDirtySlices || refcounts_->dirty_block_count() > kMaxDirtyBlocks)
    writeback_due_.store(true, std::memory_order_release);
}

Task<Status> Qcow2Writer::maybe_writeback() {
  if (!writeback_due_.load(std::memory_order_acquire)) co_return Status::ok();
  if (!writeback_lock_.try_lock()) co_return Status::ok();  // someone is writing back already
  io::AsyncMutex::Guard wb(&writeback_lock_);
  writeback_due_.store(false, std::memory_order_release);
  co_return co_await writeback_locked();
}

Task<Status> Qcow2Writer::flush() { co_return co_await check_corruption(co_await writeback()); }

Task<Status> Qcow2Writer::idle_writeback() {
  {
    auto m = co_await meta_.lock();
    if (!tracker_.has_dirty() && !refcounts_->has_dirty()) co_return Status::ok();
  }
  co_return co_await writeback();
}

Task<Status> Qcow2Writer::grow_refcount_table() {
  auto wb = co_await writeback_lock_.lock();
  auto m = co_await meta_.lock();
  co_return co_await alloc_->grow_table();
}

Task<Status> Qcow2Writer::with_refcount_room(io::AsyncMutex::Guard& m, const std::function<Task<Status>()>& step) {
  for (;;) {
    Status st = co_await step();
    if (st) co_return st;
    m.release();
    if (st.code() != EAGAIN) co_return co_await check_corruption(st);
    QCOWFS_CO_TRY(co_await grow_refcount_table());
    m = co_await meta_.lock();
  }
}

Task<Status> Qcow2Writer::close() {
  if (closed_) co_return Status::ok();
  for (int i = 0; i < 4; ++i) {
    QCOWFS_CO_TRY(co_await writeback());
    auto m = co_await meta_.lock();
    if (!tracker_.has_dirty() && !refcounts_->has_dirty()) break;
  }
  {
    auto m = co_await meta_.lock();
    QCOWFS_CO_TRY(co_await trim_preallocation());
  }
  if (set_dirty_bit_) {
    auto m = co_await meta_.lock();
    QCOWFS_CO_TRY(co_await set_incompatible_bits(img_.header.incompatible_features & ~kIncompatDirty));
    set_dirty_bit_ = false;
  }
  closed_ = true;
  co_return Status::ok();
}

// ---- resize ----

// Shrinking is refused while a cluster past the new end is allocated (its
// data would go silently); otherwise only the size field changes. The L1
// table keeps its size and place, as `qemu-img resize --shrink` leaves it
// (QEMU 7.2: qcow2_shrink_l1_table() zeroes the entries past the new end but
// never lowers l1_size); the L2 tables past the end map nothing and stay.
// Growing past the L1 table moves it (grow_l1).
Task<Status> Qcow2Writer::truncate(uint64_t new_size) {
  const uint64_t old_size = size();
  if (new_size == old_size) co_return Status::ok();
  if (marked_corrupt_) co_return corrupt_error();
  QCOWFS_CO_TRY(co_await prepare());
  const Geometry& g = img_.geometry;
  const uint64_t cs = g.cluster_size();
  auto range = co_await ranges_.lock(0, UINT64_MAX, io::RangeLock::Mode::exclusive);
  if (new_size < old_size) {
    auto m = co_await meta_.lock();
    const size_t esz = g.l2_entry_size();
    for (uint64_t c = div_round_up(new_size, cs); c < div_round_up(old_size, cs); ++c) {
      uint64_t l1_index = c / g.l2_entries();
      uint64_t l2 = l1_.entries[l1_index] & kL1OffsetMask;
      if (l2 == 0) {
        c = (l1_index + 1) * g.l2_entries() - 1;
        continue;
      }
      size_t index = 0;
      auto slice = co_await slice_for(l2, c % g.l2_entries(), &index);
      if (!slice) co_return slice.status();
      uint64_t entry = slice->entry(index, esz) & ~kOflagZero;
      uint64_t bitmap = g.extended_l2 ? slice->bitmap(index, esz) & kSubclusterAllocMask : 0;
      if (entry != 0 || bitmap != 0)
        co_return Status::errorf(EINVAL, "cannot shrink to {} bytes: guest offset {:#x} is allocated", new_size, c * cs);
    }
  }
  // data_file_raw: the data file stays a raw image of the guest size, as QEMU keeps it.
  if (img_.header.data_file_raw()) QCOWFS_CO_TRY(co_await img_.data_file->truncate(new_size));
  if (img_.header.l1_entries_for(new_size) > l1_.entries.size())
    co_return co_await grow_l1(img_.header.l1_entries_for(new_size), new_size);
  auto m = co_await meta_.lock();
  std::byte b[8];
  store_be64(b, new_size);
  QCOWFS_CO_TRY(co_await write_header_bytes(kHeaderSizeOffset, b));
  img_.header.size = new_size;
  size_.store(new_size, std::memory_order_release);
  co_return Status::ok();
}

// Called with the whole guest range locked exclusively.
Task<Status> Qcow2Writer::grow_l1(uint64_t entries, uint64_t new_size) {
  const Geometry& g = img_.geometry;
  const uint64_t cs = g.cluster_size();
  if (entries * 8 > kMaxL1Bytes)
    co_return Status::errorf(EFBIG, "a {} byte disk needs an L1 table larger than {} bytes", new_size, kMaxL1Bytes);
  auto wb = co_await writeback_lock_.lock();
  QCOWFS_CO_TRY(co_await writeback_locked());  // the old L1 on disk matches memory now
  const uint64_t clusters = div_round_up(entries * 8, cs);
  uint64_t first = 0;
  {
    auto m = co_await meta_.lock();
    for (;;) {
      auto r = co_await alloc_->allocate(clusters);
      if (r) {
        first = *r;
        break;
      }
      if (r.status().code() != EAGAIN) co_return r.status();
      QCOWFS_CO_TRY(co_await alloc_->grow_table());
    }
  }
  // The new clusters' refcounts go to disk before anything points at them.
  Status st = co_await writeback_locked();
  auto m = co_await meta_.lock();
  io::AlignedBuffer table(static_cast<size_t>(clusters * cs), img_.file->mem_align(), true);
  for (size_t i = 0; i < l1_.entries.size(); ++i) store_be64(table.data() + i * 8, l1_.entries[i]);
  if (st) st = co_await img_.file->write(table.span(), first * cs);
  if (st) st = co_await img_.file->flush();
  if (st) {
    // size, crypt_method, l1_size and l1_table_offset: one 24-byte write.
    std::byte hdr[24];
    store_be64(hdr, new_size);
    store_be32(hdr + 8, img_.header.crypt_method);
    store_be32(hdr + 12, static_cast<uint32_t>(entries));
    store_be64(hdr + 16, first * cs);
    st = co_await write_header_bytes(kHeaderSizeOffset, hdr);
  }
  if (!st) {
    (void)co_await alloc_->release(first, clusters, nullptr);
    co_return st;
  }
  uint64_t old_offset = l1_.host_offset;
  uint64_t old_clusters = div_round_up(l1_.entries.size() * 8, cs);
  l1_.entries.resize(entries, 0);
  l1_.host_offset = first * cs;
  img_.header.l1_size = static_cast<uint32_t>(entries);
  img_.header.l1_table_offset = first * cs;
  img_.header.size = new_size;
  size_.store(new_size, std::memory_order_release);
  if (old_clusters > 0 && old_offset != 0) QCOWFS_CO_TRY(co_await alloc_->release(old_offset / cs, old_clusters, nullptr));
  co_return Status::ok();
}

}  // namespace qcowfs::image::qcow2
