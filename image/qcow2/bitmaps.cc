#include "image/qcow2/bitmaps.h"

#include <algorithm>
#include <bit>

#include "image/extent/host_read.h"
#include "io/align.h"
#include "io/buffer.h"

namespace qcowfs::image::qcow2 {
namespace {

std::string bitmap_table_what(const BitmapDirEntry& e) { return fmt::format("table of bitmap '{}'", e.name); }

// Reads and checks the table of e; appends its clusters to t.held.
Task<Result<std::vector<uint64_t>>> read_bitmap_table(io::HostFile& f, const Header& h, TrackedBitmap& t) {
  const BitmapDirEntry& e = t.entry;
  const uint64_t bytes = uint64_t{e.table_size} * kBitmapTableEntrySize;
  io::AlignedBuffer buf(static_cast<size_t>(bytes), f.mem_align());
  QCOWFS_CO_TRY(co_await read_padded(f, e.table_offset, buf.span(), bitmap_table_what(e)));
  auto table = parse_bitmap_table(buf.span(), e, h.cluster_bits, f.size());
  if (!table) co_return table.status();
  t.held.push_back(BitmapHostRange{e.table_offset, align_up(bytes, h.cluster_size()), bitmap_table_what(e)});
  for (uint64_t v : *table)
    if ((v & kBitmapTableOffsetMask) != 0)
      t.held.push_back(BitmapHostRange{v & kBitmapTableOffsetMask, h.cluster_size(),
                                       fmt::format("data cluster of bitmap '{}'", e.name)});
  co_return table;
}

// QEMU's load_bitmap_data: the table must be exactly as long as the disk needs.
Task<Status> read_bitmap_bits(io::HostFile& f, const Header& h, const std::vector<uint64_t>& table, DirtyBitmap& bits) {
  const uint64_t cs = h.cluster_size();
  io::AlignedBuffer buf(static_cast<size_t>(cs), f.mem_align());
  for (uint64_t i = 0; i < table.size(); ++i) {
    const uint64_t host = table[i] & kBitmapTableOffsetMask;
    if (host == 0) {
      if (table[i] & kBitmapTableAllOnes) bits.fill_cluster(i, cs);
      continue;
    }
    QCOWFS_CO_TRY(co_await read_padded(f, host, buf.span(), "bitmap data"));
    bits.deserialize_cluster(i, buf.span());
  }
  co_return Status::ok();
}

Task<Status> load_one_bitmap(io::HostFile& f, const Header& h, bool load_data, TrackedBitmap& t, uint64_t& loaded_bytes) {
  const BitmapDirEntry& e = t.entry;
  if (e.in_use()) co_return Status::ok();  // inconsistent: its data is not read (QEMU's load_bitmap)
  auto table = co_await read_bitmap_table(f, h, t);
  if (!table) co_return table.status();
  if (e.table_size != bitmap_table_entries(h.size, e.granularity_bits, h.cluster_bits))
    co_return Status::errorf(EINVAL, "Could not read bitmap '{}' from image: its table has {} entries, the disk "
                                     "needs {}", e.name, e.table_size,
                             bitmap_table_entries(h.size, e.granularity_bits, h.cluster_bits));
  if (!load_data) co_return Status::ok();
  loaded_bytes += div_round_up(bitmap_bits(h.size, e.granularity_bits), uint64_t{8});
  if (loaded_bytes > kMaxLoadedBitmapBytes)
    co_return Status::errorf(EFBIG, "persistent bitmaps need more than {} bytes of memory", kMaxLoadedBitmapBytes);
  auto bits = std::make_shared<DirtyBitmap>(h.size, e.granularity_bits);
  QCOWFS_CO_TRY(co_await read_bitmap_bits(f, h, *table, *bits));
  t.bits = std::move(bits);
  co_return Status::ok();
}

}  // namespace

Task<Result<std::unique_ptr<PersistentBitmaps>>> PersistentBitmaps::load(io::HostFile& f, const Header& h,
                                                                         bool load_data) {
  auto out = std::make_unique<PersistentBitmaps>();
  if (!h.bitmaps || !(h.autoclear_features & kAutoclearBitmaps) || h.version < 3) co_return out;
  const BitmapsExtension& x = *h.bitmaps;  // header.cc bounded the directory's size and place
  io::AlignedBuffer dir(static_cast<size_t>(x.directory_size), f.mem_align());
  QCOWFS_CO_TRY(co_await read_padded(f, x.directory_offset, dir.span(), "bitmap directory"));
  auto entries = parse_bitmap_dir(dir.span(), x.nb_bitmaps, h.cluster_bits, h.size, f.size());
  if (!entries) co_return entries.status();
  out->dir_ = BitmapHostRange{x.directory_offset, x.directory_size, "bitmap directory"};
  uint64_t loaded_bytes = 0;
  for (BitmapDirEntry& e : *entries) {
    TrackedBitmap t{std::move(e), nullptr, {}};
    QCOWFS_CO_TRY(co_await load_one_bitmap(f, h, load_data, t, loaded_bytes));
    out->bitmaps_.push_back(std::move(t));
  }
  {
    std::lock_guard lock(out->mu_);
    out->recount();
  }
  QCOWFS_CO_TRY(check_bitmap_ranges_disjoint(out->held_ranges(h.cluster_size())));
  co_return out;
}

std::vector<BitmapHostRange> PersistentBitmaps::held_ranges(uint64_t cluster_size) const {
  std::lock_guard lock(mu_);
  std::vector<BitmapHostRange> all;
  if (dir_.length != 0) all.push_back(BitmapHostRange{dir_.offset, align_up(dir_.length, cluster_size), dir_.what});
  for (const TrackedBitmap& t : bitmaps_) all.insert(all.end(), t.held.begin(), t.held.end());
  return all;
}

bool PersistentBitmaps::empty() const {
  std::lock_guard lock(mu_);
  return bitmaps_.empty();
}

bool PersistentBitmaps::has_loaded() const {
  std::lock_guard lock(mu_);
  return std::any_of(bitmaps_.begin(), bitmaps_.end(), [](const TrackedBitmap& t) { return t.bits != nullptr; });
}

bool PersistentBitmaps::changed() const {
  std::lock_guard lock(mu_);
  return modified_ || std::any_of(bitmaps_.begin(), bitmaps_.end(), [](const TrackedBitmap& t) { return t.bits != nullptr; });
}

std::vector<BitmapDirEntry> PersistentBitmaps::entries() const {
  std::lock_guard lock(mu_);
  std::vector<BitmapDirEntry> out;
  for (const TrackedBitmap& t : bitmaps_) out.push_back(t.entry);
  return out;
}

void PersistentBitmaps::recount() {
  noting_.store(std::any_of(bitmaps_.begin(), bitmaps_.end(),
                            [](const TrackedBitmap& t) { return t.bits && t.entry.enabled(); }),
                std::memory_order_release);
}

// The unlocked check orders like the locked path: a write whose note comes
// before an add()/enable's store of noting_ may miss the new bitmap, as it
// would by taking the mutex first; one after it (e.g. a write issued once
// the `qcowfs bitmap` request returned) reads true and takes the mutex.
void PersistentBitmaps::note_write(uint64_t guest, uint64_t len) {
  if (!noting_.load(std::memory_order_acquire)) return;
  std::lock_guard lock(mu_);
  for (TrackedBitmap& t : bitmaps_)
    if (t.bits && t.entry.enabled()) t.bits->set(guest, len);
}

std::optional<std::vector<DirtyRange>> PersistentBitmaps::dirty_ranges(std::string_view name) const {
  std::lock_guard lock(mu_);
  for (const TrackedBitmap& t : bitmaps_)
    if (t.entry.name == name && t.bits) return t.bits->dirty_ranges();
  return std::nullopt;
}

std::optional<DirtyRun> PersistentBitmaps::run_at(std::string_view name, uint64_t guest, uint64_t len) const {
  std::lock_guard lock(mu_);
  for (const TrackedBitmap& t : bitmaps_)
    if (t.entry.name == name && t.bits) return t.bits->run_at(guest, len);
  return std::nullopt;
}

std::vector<BitmapSummary> PersistentBitmaps::summaries() const {
  std::lock_guard lock(mu_);
  std::vector<BitmapSummary> out;
  for (const TrackedBitmap& t : bitmaps_)
    out.push_back(BitmapSummary{t.entry, t.bits != nullptr, t.bits ? t.bits->dirty_bytes() : 0});
  return out;
}

std::vector<BitmapDirEntry> PersistentBitmaps::mark_in_use() {
  std::lock_guard lock(mu_);
  std::vector<BitmapDirEntry> out;
  for (TrackedBitmap& t : bitmaps_) {
    if (t.bits) t.entry.flags |= kBitmapFlagInUse;
    out.push_back(t.entry);
  }
  return out;
}

Status PersistentBitmaps::check_resize() const {
  std::lock_guard lock(mu_);
  for (const TrackedBitmap& t : bitmaps_) {
    if (t.entry.in_use() && !t.bits)
      return Status::errorf(ENOTSUP, "Bitmap '{}' is inconsistent and cannot be used", t.entry.name);
    if (!t.bits)
      return Status::error(ENOTSUP, "Cannot resize qcow2 with persistent bitmaps that were not loaded into memory");
  }
  return Status::ok();
}

void PersistentBitmaps::resize(uint64_t disk_size) {
  std::lock_guard lock(mu_);
  for (TrackedBitmap& t : bitmaps_)
    if (t.bits) t.bits->resize(disk_size);
}

TrackedBitmap* PersistentBitmaps::find(const std::string& name) {
  for (TrackedBitmap& t : bitmaps_)
    if (t.entry.name == name) return &t;
  return nullptr;
}

const TrackedBitmap* PersistentBitmaps::find(const std::string& name) const {
  for (const TrackedBitmap& t : bitmaps_)
    if (t.entry.name == name) return &t;
  return nullptr;
}

// QEMU's block_dirty_bitmap_lookup + bdrv_dirty_bitmap_check(BDRV_BITMAP_DEFAULT).
Status PersistentBitmaps::find_consistent(const std::string& name, TrackedBitmap** out) {
  TrackedBitmap* t = find(name);
  if (!t) return Status::errorf(ENOENT, "Dirty bitmap '{}' not found", name);
  if (!t->bits) return Status::errorf(EINVAL, "Bitmap '{}' is inconsistent and cannot be used", name);
  *out = t;
  return Status::ok();
}

Status PersistentBitmaps::add(const std::string& name, uint64_t granularity, bool enabled, uint64_t disk_size,
                              uint32_t cluster_bits) {
  std::lock_guard lock(mu_);
  if (find(name)) return Status::errorf(EEXIST, "Bitmap already exists: {}", name);
  if (Status st = check_new_bitmap(disk_size, cluster_bits, name, granularity); !st)
    return Status::errorf(EINVAL, "Can't make bitmap '{}' persistent: {}", name, st.message());
  if (bitmaps_.size() + 1 > kMaxBitmaps)
    return Status::errorf(EINVAL, "Can't make bitmap '{}' persistent: Maximum number of persistent bitmaps is "
                                  "already reached", name);
  TrackedBitmap t;
  t.entry.name = name;
  t.entry.granularity_bits = static_cast<uint8_t>(std::countr_zero(granularity));
  t.entry.flags = enabled ? kBitmapFlagAuto : 0;
  t.bits = std::make_shared<DirtyBitmap>(disk_size, t.entry.granularity_bits);
  bitmaps_.push_back(std::move(t));
  modified_ = true;
  recount();
  return Status::ok();
}

Status PersistentBitmaps::remove(const std::string& name) {
  std::lock_guard lock(mu_);
  auto it = std::find_if(bitmaps_.begin(), bitmaps_.end(), [&](const TrackedBitmap& t) { return t.entry.name == name; });
  if (it == bitmaps_.end()) return Status::errorf(ENOENT, "Dirty bitmap '{}' not found", name);
  // An inconsistent bitmap's clusters are freed when read_unloaded_table()
  // could read its table (hold()), else they leak, as QEMU leaves them.
  removed_.insert(removed_.end(), it->held.begin(), it->held.end());
  bitmaps_.erase(it);
  modified_ = true;
  recount();
  return Status::ok();
}

Task<Result<std::vector<BitmapHostRange>>> PersistentBitmaps::read_unloaded_table(io::HostFile& f, const Header& h,
                                                                                  const std::string& name) const {
  TrackedBitmap t;
  {
    std::lock_guard lock(mu_);
    const TrackedBitmap* found = find(name);
    if (!found || found->bits || !found->held.empty()) co_return std::vector<BitmapHostRange>{};
    t.entry = found->entry;
  }
  auto table = co_await read_bitmap_table(f, h, t);
  if (!table) co_return table.status();
  std::vector<BitmapHostRange> all = held_ranges(h.cluster_size());
  all.insert(all.end(), t.held.begin(), t.held.end());
  QCOWFS_CO_TRY(check_bitmap_ranges_disjoint(std::move(all)));
  co_return std::move(t.held);
}

void PersistentBitmaps::hold(const std::string& name, std::vector<BitmapHostRange> ranges) {
  std::lock_guard lock(mu_);
  if (TrackedBitmap* t = find(name)) t->held.insert(t->held.end(), ranges.begin(), ranges.end());
}

Status PersistentBitmaps::clear(const std::string& name) {
  std::lock_guard lock(mu_);
  TrackedBitmap* t = nullptr;
  QCOWFS_TRY(find_consistent(name, &t));
  t->bits->clear();
  modified_ = true;
  return Status::ok();
}

Status PersistentBitmaps::set_enabled(const std::string& name, bool enabled) {
  std::lock_guard lock(mu_);
  TrackedBitmap* t = nullptr;
  QCOWFS_TRY(find_consistent(name, &t));
  t->entry.flags = enabled ? (t->entry.flags | kBitmapFlagAuto) : (t->entry.flags & ~kBitmapFlagAuto);
  modified_ = true;
  recount();
  return Status::ok();
}

Status PersistentBitmaps::merge(const std::string& dst, const DirtyBitmap& src) {
  std::lock_guard lock(mu_);
  TrackedBitmap* t = nullptr;
  QCOWFS_TRY(find_consistent(dst, &t));
  if (src.granularity_bits() == t->bits->granularity_bits() && src.disk_size() == t->bits->disk_size()) {
    t->bits->merge(src);
    modified_ = true;
    return Status::ok();
  }
  // Different granularity or size (QEMU's hbitmap_merge): every dirty range of src.
  for (const DirtyRange& r : src.dirty_ranges()) t->bits->set(r.offset, r.length);
  modified_ = true;
  return Status::ok();
}

Result<DirtyBitmap> PersistentBitmaps::bits_of(const std::string& name) const {
  std::lock_guard lock(mu_);
  const TrackedBitmap* t = find(name);
  if (!t) return Status::errorf(ENOENT, "Dirty bitmap '{}' not found", name);
  if (!t->bits) return Status::errorf(EINVAL, "Bitmap '{}' is inconsistent and cannot be used", name);
  return *t->bits;
}

BitmapStoreSet PersistentBitmaps::store_set() const {
  std::lock_guard lock(mu_);
  BitmapStoreSet s;
  for (const TrackedBitmap& t : bitmaps_) {
    TrackedBitmap c{t.entry, t.bits ? std::make_shared<DirtyBitmap>(*t.bits) : nullptr, t.held};
    s.bitmaps.push_back(std::move(c));
  }
  s.free_after = removed_;
  if (dir_.length != 0) s.free_after.push_back(dir_);
  return s;
}

void PersistentBitmaps::stored(std::vector<TrackedBitmap> done, BitmapHostRange dir) {
  std::lock_guard lock(mu_);
  for (TrackedBitmap& n : done)
    if (TrackedBitmap* t = find(n.entry.name)) {
      t->entry = n.entry;
      t->held = std::move(n.held);
    }
  removed_.clear();
  modified_ = false;
  recount();
  dir_ = std::move(dir);
}

}  // namespace qcowfs::image::qcow2
