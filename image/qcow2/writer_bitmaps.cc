// Qcow2Writer: persistent dirty bitmaps (bitmaps.h). Loaded at open, marked
// IN_USE on disk before the first change, updated by every guest write,
// write-zeroes and discard, stored at close. The ordering rules are in
// image/qcow2/DESIGN.md ("Bitmap write ordering").
#include <algorithm>
#include <cstddef>

#include "image/endian.h"
#include "image/qcow2/writer_plan.h"
#include "io/align.h"
#include "io/buffer.h"
#include "io/log.h"

namespace qcowfs::image::qcow2 {
namespace {

uint64_t bitmap_clusters_for(uint64_t bytes, uint32_t cluster_bits) {
  return div_round_up(bytes, uint64_t{1} << cluster_bits);
}

}  // namespace

Task<Status> Qcow2Writer::load_bitmaps() {
  auto b = co_await PersistentBitmaps::load(*img_.file, img_.header, true);
  if (!b) co_return b.status();
  // The clusters a store frees must hold nothing else (QEMU's overlap checks
  // would catch a bitmap on other metadata only when writing it).
  for (const BitmapHostRange& r : (*b)->held_ranges(img_.geometry.cluster_size()))
    if (const MetadataRange* m = img_.layout.overlap(r.offset, r.length))
      co_return Status::errorf(EINVAL, "{} at {:#x} overlaps the {}", r.what, r.offset, m->what);
  bitmaps_ = std::move(*b);
  co_return Status::ok();
}

Task<void> Qcow2Writer::adopt_bitmap_table(const std::string& name) {
  auto ranges = co_await bitmaps_->read_unloaded_table(*img_.file, img_.header, name);
  Status st = ranges.status();
  if (ranges)
    for (const BitmapHostRange& r : *ranges)
      if (const MetadataRange* m = img_.layout.overlap(r.offset, r.length)) {
        st = Status::errorf(EINVAL, "{} at {:#x} overlaps the {}", r.what, r.offset, m->what);
        break;
      }
  if (!st) {
    log::warn("{}: inconsistent bitmap '{}': {}; its clusters stay allocated (qemu-img check -r leaks frees them)",
              img_.path, name, st.message());
    co_return;
  }
  bitmaps_->hold(name, std::move(*ranges));
}

void Qcow2Writer::note_guest_change(GuestOffset guest, uint64_t len) {
  if (bitmaps_) bitmaps_->note_write(guest, len);
}

// One 8-byte write of autoclear_features, then a flush.
Task<Status> Qcow2Writer::write_autoclear(uint64_t bits) {
  QCOWFS_CO_TRY(co_await write_header_u64(offsetof(HeaderLayout, autoclear_features), bits));
  img_.header.autoclear_features = bits;
  co_return Status::ok();
}

// QEMU's update_ext_header_and_dir_in_place: with the autoclear bit cleared
// (flushed), the directory is rewritten in place with IN_USE set on every
// loaded bitmap (same size: only flags change) and flushed, then the bit is
// set again (flushed). A crash in between leaves the bit clear: every bitmap
// is then dropped by whoever opens the image next, never trusted half-written.
// Metadata lock held.
Task<Status> Qcow2Writer::mark_bitmaps_in_use() {
  if (!bitmaps_ || !bitmaps_->has_loaded()) co_return Status::ok();
  const std::vector<std::byte> dir = serialize_bitmap_dir(bitmaps_->mark_in_use());
  const BitmapHostRange& at = bitmaps_->directory();
  if (dir.size() != at.length)
    co_return Status::errorf(EIO, "bitmap directory of {} bytes rewritten as {}", at.length, dir.size());
  const uint64_t bits = img_.header.autoclear_features;
  QCOWFS_CO_TRY(co_await write_autoclear(bits & ~kAutoclearBitmaps));
  QCOWFS_CO_TRY(co_await img_.file->write(at.offset, dir));
  QCOWFS_CO_TRY(co_await img_.file->flush());
  co_return co_await write_autoclear(bits | kAutoclearBitmaps);
}

// n clusters for bitmap metadata (refcount 1 in the cache; durable with the next write-back).
Task<Result<HostOffset>> Qcow2Writer::allocate_bitmap_clusters(uint64_t n) {
  auto m = co_await meta_.lock();
  HostCluster hc = 0;
  auto step = [&]() -> Task<Status> {
    auto r = co_await alloc_->allocate(n);
    if (!r) co_return r.status();
    hc = *r;
    co_return Status::ok();
  };
  QCOWFS_CO_TRY(co_await with_refcount_room(m, step));
  QCOWFS_CO_TRY(check_fresh(hc, n));
  co_return hc << img_.geometry.cluster_bits;
}

// Writes whole clusters at host (bytes zero-padded).
Task<Status> Qcow2Writer::write_bitmap_clusters(HostOffset host, std::span<const std::byte> bytes) {
  const uint64_t cs = img_.geometry.cluster_size();
  io::AlignedBuffer buf(static_cast<size_t>(align_up(bytes.size(), cs)), img_.file->mem_align());
  std::copy(bytes.begin(), bytes.end(), buf.data());
  co_return co_await img_.file->write(host, buf.span());
}

// QEMU's store_bitmap: the data clusters that are not all zeros, then the
// table (0 entries for the rest). t.entry gets the new table, IN_USE cleared;
// t.held the new clusters (also appended to fresh).
Task<Status> Qcow2Writer::store_bitmap(TrackedBitmap& t, std::vector<BitmapHostRange>& fresh) {
  const uint32_t bits = img_.geometry.cluster_bits;
  const uint64_t cs = img_.geometry.cluster_size();
  const DirtyBitmap& b = *t.bits;
  const uint64_t entries = bitmap_table_entries(b.disk_size(), b.granularity_bits(), bits);
  io::AlignedBuffer data(static_cast<size_t>(cs), img_.file->mem_align());
  std::vector<uint64_t> used;
  for (uint64_t i = 0; i < entries; ++i)
    if (b.serialize_cluster(i, data.span())) used.push_back(i);
  std::vector<std::byte> table(static_cast<size_t>(entries * kBitmapTableEntrySize));
  std::vector<BitmapHostRange> held;
  const std::string what = fmt::format("bitmap '{}'", t.entry.name);
  if (!used.empty()) {
    auto host = co_await allocate_bitmap_clusters(used.size());
    if (!host) co_return host.status();
    held.push_back(BitmapHostRange{*host, used.size() * cs, "data of " + what});
    fresh.push_back(held.back());
    for (size_t k = 0; k < used.size(); ++k) {
      (void)b.serialize_cluster(used[k], data.span());
      QCOWFS_CO_TRY(co_await img_.file->write(*host + k * cs, data.span()));
      store_be64(table.data() + used[k] * kBitmapTableEntrySize, *host + k * cs);
    }
  }
  auto table_host = co_await allocate_bitmap_clusters(bitmap_clusters_for(table.size(), bits));
  if (!table_host) co_return table_host.status();
  held.push_back(BitmapHostRange{*table_host, bitmap_clusters_for(table.size(), bits) * cs, "table of " + what});
  fresh.push_back(held.back());
  QCOWFS_CO_TRY(co_await write_bitmap_clusters(*table_host, table));
  t.entry.table_offset = *table_host;
  t.entry.table_size = static_cast<uint32_t>(entries);
  t.entry.flags &= ~kBitmapFlagInUse;
  t.held = std::move(held);
  co_return Status::ok();
}

// The header with the bitmaps extension naming dir (none when dir is empty),
// the refcount table where it is now; one write of the header cluster, flush.
// Metadata lock held.
Task<Status> Qcow2Writer::write_bitmaps_extension(uint32_t nb_bitmaps, const BitmapHostRange& dir) {
  Header next = img_.header;
  next.refcount_table_offset = refcounts_->table_offset();
  next.refcount_table_clusters = refcounts_->table_clusters();
  if (nb_bitmaps == 0) {
    next.bitmaps.reset();
    next.autoclear_features &= ~kAutoclearBitmaps;
  } else {
    next.bitmaps = BitmapsExtension{nb_bitmaps, dir.length, dir.offset};
    next.autoclear_features |= kAutoclearBitmaps;
  }
  auto bytes = serialize_header(next);
  if (!bytes) co_return bytes.status();
  QCOWFS_CO_TRY(co_await write_header_bytes(0, *bytes));
  img_.header = std::move(next);
  co_return Status::ok();
}

Task<Status> Qcow2Writer::release_bitmap_ranges(const std::vector<BitmapHostRange>& ranges) {
  const uint32_t bits = img_.geometry.cluster_bits;
  auto m = co_await meta_.lock();
  for (const BitmapHostRange& r : ranges) {
    if (r.length == 0) continue;
    const HostCluster first_hc = r.offset >> bits, last_hc = (r.offset + r.length - 1) >> bits;
    QCOWFS_CO_TRY(co_await alloc_->release(first_hc, last_hc - first_hc + 1, nullptr));
  }
  co_return Status::ok();
}

// QEMU's qcow2_store_persistent_dirty_bitmaps, in the order of DESIGN.md:
// new data, tables and directory written; their refcounts written back and
// everything flushed; one header write (flushed) switches to the new
// directory; only then are the old tables, data and directory freed.
Task<Status> Qcow2Writer::store_bitmaps() {
  if (!bitmaps_ || state() == State::opened || !bitmaps_->changed()) co_return Status::ok();
  // A corrupt image gets no new metadata: its bitmaps stay marked in use.
  if (img_.corruption.seen()) co_return Status::ok();
  BitmapStoreSet set = bitmaps_->store_set();
  std::vector<BitmapHostRange> fresh, old = set.free_after;
  std::vector<BitmapDirEntry> entries;
  Status st = Status::ok();
  for (TrackedBitmap& t : set.bitmaps) {
    if (t.bits) {
      old.insert(old.end(), t.held.begin(), t.held.end());
      st = co_await store_bitmap(t, fresh);
      if (!st) break;
    }
    entries.push_back(t.entry);
  }
  BitmapHostRange dir{0, 0, "bitmap directory"};
  if (st && !entries.empty()) {
    const std::vector<std::byte> bytes = serialize_bitmap_dir(entries);
    auto host = co_await allocate_bitmap_clusters(bitmap_clusters_for(bytes.size(), img_.geometry.cluster_bits));
    if (host) {
      dir.offset = *host;
      dir.length = bytes.size();
      fresh.push_back(BitmapHostRange{*host, align_up(bytes.size(), img_.geometry.cluster_size()), dir.what});
      st = co_await write_bitmap_clusters(*host, bytes);
    } else {
      st = host.status();
    }
  }
  if (st) st = co_await writeback();
  if (st) st = co_await img_.file->flush();
  if (st) {
    auto m = co_await meta_.lock();
    st = co_await write_bitmaps_extension(static_cast<uint32_t>(entries.size()), dir);
  }
  if (!st) {
    log::error("{}: storing persistent bitmaps: {} (they stay marked in use)", img_.path, st.message());
    (void)co_await release_bitmap_ranges(fresh);
    co_return st;
  }
  bitmaps_->stored(std::move(set.bitmaps), dir);
  co_return co_await release_bitmap_ranges(old);
}

}  // namespace qcowfs::image::qcow2
