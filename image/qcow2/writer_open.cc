// Qcow2Writer: open, the header feature state (autoclear bits, dirty bit,
// refcount repair of a dirty image), corruption handling and close.
#include <algorithm>
#include <cstddef>

#include "image/endian.h"
#include "image/qcow2/qcow2_check.h"
#include "image/qcow2/writer_plan.h"
#include "io/align.h"
#include "io/log.h"

namespace qcowfs::image::qcow2 {
namespace {

// Refcount blocks cached by the writer: 4 MiB worth, at least 16.
size_t refcount_cache_blocks(uint32_t cluster_bits) {
  return std::max<size_t>(16, static_cast<size_t>((4ull << 20) >> cluster_bits));
}

// close() writes back until nothing is dirty, at most this many times
// (releases applied by one writeback dirty refcount blocks for the next).
constexpr int kCloseWritebackRounds = 4;

}  // namespace

Qcow2Writer::Qcow2Writer(Qcow2Image& image, L1Table& l1, ReadPath& reads, bool discard_unmap, bool compress)
    : img_(image),
      l1_(l1),
      reads_(reads),
      discard_unmap_(discard_unmap),
      compress_(compress),
      size_(image.header.size),
      bitmaps_(std::make_unique<PersistentBitmaps>()) {}

Task<Result<std::unique_ptr<Qcow2Writer>>> Qcow2Writer::open(Qcow2Image& image, L1Table& l1, ReadPath& reads,
                                                             const ImageOptions& opts) {
  if (opts.compress_writes) QCOWFS_CO_TRY(check_compress_allowed(image));
  auto w = std::make_unique<Qcow2Writer>(image, l1, reads, opts.discard_unmap, opts.compress_writes);
  if (image.header.dirty()) QCOWFS_CO_TRY(co_await w->repair_refcounts());
  QCOWFS_CO_TRY(co_await w->load_refcounts());
  QCOWFS_CO_TRY(co_await w->load_bitmaps());
  co_return w;
}

Task<Status> Qcow2Writer::load_refcounts() {
  const Header& h = img_.header;
  auto rt = co_await RefcountTable::load(*img_.file, h.cluster_bits, h.refcount_order, h.refcount_table_offset,
                                         h.refcount_table_clusters, refcount_cache_blocks(h.cluster_bits));
  if (!rt) co_return rt.status();
  refcounts_ = std::move(*rt);
  auto used = co_await refcounts_->end_of_used();
  if (!used) co_return used.status();
  const HostCluster end_hc = std::max(div_round_up(img_.file->size(), h.cluster_size()), *used);
  alloc_ = std::make_unique<ClusterAllocator>(*refcounts_, end_hc);
  alloc_->set_hint(0);
  co_return Status::ok();
}

bool Qcow2Writer::has_backing() const { return img_.backing != nullptr; }

// ---- header ----

Task<Status> Qcow2Writer::write_header_bytes(uint64_t header_offset, std::span<const std::byte> bytes) {
  QCOWFS_CO_TRY(co_await img_.file->write(header_offset, bytes));
  co_return co_await img_.file->flush();
}

Task<Status> Qcow2Writer::write_header_u64(uint64_t header_offset, uint64_t value) {
  std::byte b[sizeof(uint64_t)];
  store_be64(b, value);
  co_return co_await write_header_bytes(header_offset, b);
}

Task<Status> Qcow2Writer::set_incompatible_bits(uint64_t bits) {
  QCOWFS_CO_TRY(co_await write_header_u64(offsetof(HeaderLayout, incompatible_features), bits));
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
  if (!layout) co_return co_await img_.signal_corruption(layout.status().message());
  img_.layout = std::move(*layout);
  co_return co_await set_incompatible_bits(img_.header.incompatible_features & ~kIncompatDirty);
}

// Autoclear bits this writer does not maintain are cleared before the first
// change, as the qcow2 spec asks of a program that does not know them. The
// bitmaps bit stays when the bitmaps are maintained (keep_bitmaps: the bit
// was set at open and the directory loaded). A bitmaps extension found
// without the bit is stale (QEMU: "a program lacking bitmap support modified
// this file"): it is dropped in the same header write, its clusters left
// leaked as QEMU leaves them (`qemu-img check -r leaks` frees them).
// Metadata lock held.
Task<Status> Qcow2Writer::clear_autoclear_features(bool keep_bitmaps) {
  Header& h = img_.header;
  Header next = h;
  next.autoclear_features &= kAutoclearDataFileRaw | (keep_bitmaps ? kAutoclearBitmaps : 0);
  if (!keep_bitmaps) next.bitmaps.reset();
  auto bytes = serialize_header(next);
  if (!bytes) co_return bytes.status();
  QCOWFS_CO_TRY(co_await write_header_bytes(0, *bytes));
  log::info("{}: cleared autoclear feature bits {:#x} (not maintained by this writer){}", img_.path,
            h.autoclear_features & ~next.autoclear_features,
            h.bitmaps && !keep_bitmaps ? ", stale persistent bitmaps dropped" : "");
  h = std::move(next);
  co_return Status::ok();
}

// Before the first change: clear autoclear bits we do not maintain and, with
// lazy refcounts, set the dirty bit (each one header write + flush).
Task<Status> Qcow2Writer::prepare() {
  if (state() != State::opened) co_return Status::ok();
  auto m = co_await meta_.lock();
  if (state() != State::opened) co_return Status::ok();
  co_return co_await prepare_locked();
}

// State opened -> clean, or -> dirty when we set the dirty bit. Metadata lock held.
Task<Status> Qcow2Writer::prepare_locked() {
  Header& h = img_.header;
  State next = State::clean;
  if (h.version >= 3) {
    const bool keep_bitmaps = (h.autoclear_features & kAutoclearBitmaps) && h.bitmaps && !bitmaps_->empty();
    const uint64_t kept = kAutoclearDataFileRaw | (keep_bitmaps ? kAutoclearBitmaps : 0);
    if ((h.autoclear_features & ~kept) != 0 || (h.bitmaps && !keep_bitmaps))
      QCOWFS_CO_TRY(co_await clear_autoclear_features(keep_bitmaps));
    if (keep_bitmaps) QCOWFS_CO_TRY(co_await mark_bitmaps_in_use());
    if ((h.compatible_features & kCompatLazyRefcounts) && !h.dirty()) {
      QCOWFS_CO_TRY(co_await set_incompatible_bits(h.incompatible_features | kIncompatDirty));
      next = State::dirty;
    }
  }
  state_.store(next, std::memory_order_release);
  co_return Status::ok();
}

// ---- corruption ----

Status Qcow2Writer::corruption(std::string what) const { return img_.corruption.found(img_.path, std::move(what)); }

Task<Status> Qcow2Writer::check_corruption(Status st) {
  if (st) co_return st;
  bool refcounts_corrupt;
  {
    auto m = co_await meta_.lock();
    refcounts_corrupt = refcounts_->corruption_found();
  }
  if (refcounts_corrupt && !img_.corruption.seen()) (void)corruption(fmt::format("refcounts: {}", st.message()));
  if (!img_.corruption.seen()) co_return st;
  if (!co_await img_.corruption.mark(*img_.file, img_.header, img_.path)) co_return st;
  co_return Status::error(EIO, st.message());
}

// ---- close ----

// Any state -> closed.
Task<Status> Qcow2Writer::close() {
  if (state() == State::closed) co_return Status::ok();
  QCOWFS_CO_TRY(co_await write_back_all());
  // A failure to store the bitmaps leaves them IN_USE (QEMU's outcome after
  // a crash); the rest of close still runs and the error is returned.
  const Status stored = co_await store_bitmaps();
  if (stored) QCOWFS_CO_TRY(co_await write_back_all());
  QCOWFS_CO_TRY(co_await close_locked());
  co_return stored;
}

Task<Status> Qcow2Writer::close_locked() {
  auto m = co_await meta_.lock();
  QCOWFS_CO_TRY(co_await trim_preallocation());
  QCOWFS_CO_TRY(co_await align_file_end());
  if (state() == State::dirty) QCOWFS_CO_TRY(co_await clear_dirty_bit());
  state_.store(State::closed, std::memory_order_release);
  co_return Status::ok();
}

Task<Status> Qcow2Writer::write_back_all() {
  for (int i = 0; i < kCloseWritebackRounds; ++i) {
    QCOWFS_CO_TRY(co_await writeback());
    auto m = co_await meta_.lock();
    if (!tracker_.has_dirty() && !refcounts_->has_dirty()) break;
  }
  co_return Status::ok();
}

// State dirty -> clean. Metadata lock held.
Task<Status> Qcow2Writer::clear_dirty_bit() {
  QCOWFS_CO_TRY(co_await set_incompatible_bits(img_.header.incompatible_features & ~kIncompatDirty));
  state_.store(State::clean, std::memory_order_release);
  co_return Status::ok();
}

}  // namespace qcowfs::image::qcow2
