// The VMDK guest-to-host map: extents (consecutive guest ranges, in
// descriptor order) over their host files, FLAT ones 1:1, sparse ones through
// the grain directory (in memory) and grain tables (4 KiB windows of the file
// in a TableCache). QEMU 7.2 block/vmdk.c: get_cluster_offset,
// vmdk_co_block_status, vmdk_read_extent.
// Thread-safety: the map is immutable after construction but for the
// thread-safe TableCaches and the grain-table entries a VmdkWriter stores in
// their windows (atomically: load_gte/store_gte); try_map() never suspends.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "image/endian.h"
#include "image/extent/driver.h"
#include "image/extent/table_cache.h"
#include "image/vmdk/format.h"

namespace qcowfs::image::vmdk {

// Grain tables are read in windows of this size, aligned in the file.
constexpr size_t kGtWindow = TableCache::kDefaultSliceSize;

// One extent: a consecutive guest range in one host file.
struct VExtent {
  uint64_t start = 0;  // guest bytes
  uint64_t size = 0;   // guest bytes
  io::HostFile* file = nullptr;
  bool flat = false;
  uint64_t flat_offset = 0;  // bytes
  // Sparse extents:
  bool compressed = false, markers = false, zero_grain = false;
  uint64_t grain_bytes = 0;
  uint32_t gtes = 0;            // entries per grain table
  uint64_t gd_coverage = 0;     // bytes one GD entry maps (QEMU's l1_entry_sectors)
  uint32_t gd_size = 0;         // GD entries (QEMU's l1_size)
  std::vector<uint32_t> gd;     // the entries inside the file; the rest read as 0
  TableCache* cache = nullptr;  // the grain-table windows of `file`
  // What a writable open checks and writes (KDMV; bytes in the file):
  bool vmdk3 = false;
  uint64_t gd_offset = 0;
  uint64_t rgd_offset = 0;  // 0: no redundant grain directory
  uint64_t grain_offset = 0;
  uint64_t desc_offset = 0, desc_size = 0;  // an embedded descriptor
  std::vector<uint32_t> rgd;                // the redundant GD (writable opens only)
  // For info:
  std::string type, filename;
};

// What every extent of one host file shares.
struct HostFileState {
  std::unique_ptr<io::HostFile> owned;
  io::HostFile* file = nullptr;
  std::unique_ptr<TableCache> cache;  // grain tables, in kSlice windows of the file
  uint64_t tail_slice = 0;            // the window that crosses the end of the file
  std::vector<std::byte> tail_bytes;  // its bytes, zero-padded (empty: none)
};

class VmdkMap final : public ExtentMap {
 public:
  VmdkMap(std::string path, std::vector<VExtent> extents, std::vector<HostFileState> files)
      : path_(std::move(path)), extents_(std::move(extents)), files_(std::move(files)) {}

  Result<std::optional<Extent>> try_map(uint64_t guest, uint64_t len) override {
    const VExtent& x = find(guest);
    uint64_t rel = guest - x.start;
    len = std::min(len, x.size - rel);
    if (x.flat) {
      Extent e;
      e.kind = ExtentKind::data;
      e.length = len;
      e.file = x.file;
      e.host_offset = x.flat_offset + rel;
      e.host_holes_are_zero = true;
      return std::optional<Extent>(e);
    }
    return map_sparse(x, guest, rel, len, nullptr);
  }

  Task<Result<Extent>> map(uint64_t guest, uint64_t len) override {
    const VExtent& x = find(guest);
    uint64_t rel = guest - x.start;
    TableCache::Ref ref;
    if (!x.flat) {
      auto slice = slice_of(x, rel);
      if (!slice) co_return slice.status();
      if (*slice != kNoSlice) {
        auto r = co_await x.cache->get(*slice);
        if (!r) co_return r.status().with_context(fmt::format("{}: guest offset {:#x}", path_, guest));
        ref = std::move(*r);
      }
    }
    auto e = ref ? map_sparse(x, guest, rel, std::min(len, x.size - rel), &ref) : try_map(guest, len);
    if (!e) co_return e.status();
    if (!*e) co_return Status::errorf(EIO, "{}: no mapping for guest offset {:#x}", path_, guest);
    co_return **e;
  }

  Status decompress(const Extent& e, std::span<const std::byte> stream, std::span<std::byte> out) const override;

 public:
  static constexpr uint64_t kNoSlice = ~0ull;

  const std::vector<VExtent>& extents() const { return extents_; }
  // A grain-table entry in a cached window, atomically (readers run
  // concurrently with the writer's stores; little-endian on disk).
  static uint32_t load_gte(const TableCache::Ref& ref, size_t at);
  static void store_gte(TableCache::Ref& ref, size_t at, uint32_t gte);

  // The extent holding guest byte `guest` (< the disk's size).
  const VExtent& find(uint64_t guest) const {
    auto it = std::upper_bound(extents_.begin(), extents_.end(), guest,
                               [](uint64_t g, const VExtent& x) { return g < x.start; });
    return *(it - 1);
  }
  const VExtent& find_by_file(const Extent& e) const {
    for (const VExtent& x : extents_)
      if (x.file == e.file && x.compressed) return x;
    return extents_.front();
  }
  const HostFileState& state_of(const VExtent& x) const {
    for (const HostFileState& s : files_)
      if (s.file == x.file) return s;
    return files_.front();
  }

 private:
  // The GD entry for rel: the grain table's sector, 0 for none.
  Result<uint32_t> gd_entry(const VExtent& x, uint64_t rel, uint64_t guest) const {
    uint64_t index = rel / x.gd_coverage;
    if (index >= x.gd_size)
      return Status::errorf(EIO, "{}: guest offset {:#x} is past the grain directory ({} entries)", path_, guest,
                            x.gd_size);
    return index < x.gd.size() ? x.gd[index] : 0u;
  }

  // Host byte offset of rel's grain-table entry (kNoSlice: no grain table).
 public:
  Result<uint64_t> entry_offset(const VExtent& x, uint64_t rel, uint64_t guest) const {
    auto gt = gd_entry(x, rel, guest);
    if (!gt) return gt.status();
    if (*gt == 0) return kNoSlice;
    uint64_t index = (rel / x.grain_bytes) % x.gtes;
    return uint64_t{*gt} * kSector + index * 4;
  }

 private:
  // The cached window holding rel's grain-table entry; kNoSlice when it needs none.
  Result<uint64_t> slice_of(const VExtent& x, uint64_t rel) const {
    auto at = entry_offset(x, rel, x.start + rel);
    if (!at) return at.status();
    if (*at == kNoSlice) return kNoSlice;
    uint64_t slice = *at / kGtWindow * kGtWindow;
    if (slice + kGtWindow > x.file->size()) return kNoSlice;  // tail window or past the end: in memory
    return slice;
  }

  // Reads the entry at host byte `at` from `ref` (that window) or from memory;
  // nullopt when the window is not cached.
  std::optional<uint32_t> entry(const VExtent& x, uint64_t at, TableCache::Ref* ref) const {
    uint64_t slice = at / kGtWindow * kGtWindow;
    const HostFileState& s = state_of(x);
    if (slice + kGtWindow > x.file->size()) {
      if (!s.tail_bytes.empty() && slice == s.tail_slice) return load_le32(s.tail_bytes.data() + (at - slice));
      return 0u;  // past the end of the file: QEMU reads zeros
    }
    if (ref && *ref && ref->host_offset() == slice) return load_gte(*ref, static_cast<size_t>(at - slice));
    auto r = x.cache->try_get(slice);
    if (!r) return std::nullopt;
    return load_gte(*r, static_cast<size_t>(at - slice));
  }

  Extent grain_extent(const VExtent& x, uint64_t rel, uint64_t len, uint32_t gte) const {
    uint64_t in_grain = rel % x.grain_bytes;
    Extent e;
    e.length = std::min(len, x.grain_bytes - in_grain);
    if (gte == 0) {
      e.kind = ExtentKind::unallocated;
    } else if (x.zero_grain && gte == kGteZeroed) {
      e.kind = ExtentKind::zero;
    } else if (x.compressed) {
      e.kind = ExtentKind::compressed;
      e.file = x.file;
      e.host_offset = uint64_t{gte} * kSector;
      e.unit_offset = in_grain;
      e.unit_size = std::min(x.grain_bytes, x.size - (rel - in_grain));
      e.stored_size = 2 * x.grain_bytes;
    } else {
      e.kind = ExtentKind::data;
      e.file = x.file;
      e.host_offset = uint64_t{gte} * kSector + in_grain;
    }
    return e;
  }

  static bool extends(const Extent& a, const Extent& b) {
    if (a.kind != b.kind || a.kind == ExtentKind::compressed) return false;
    return a.kind != ExtentKind::data || a.host_offset + a.length == b.host_offset;
  }

  Result<std::optional<Extent>> map_sparse(const VExtent& x, uint64_t guest, uint64_t rel, uint64_t len,
                                           TableCache::Ref* ref) const {
    auto at = entry_offset(x, rel, guest);
    if (!at) return at.status();
    if (*at == kNoSlice) {  // no grain table: unallocated to the end of the GD entry
      Extent e;
      e.length = std::min(len, x.gd_coverage - rel % x.gd_coverage);
      return std::optional<Extent>(e);
    }
    auto gte = entry(x, *at, ref);
    if (!gte) return std::optional<Extent>();
    Extent e = grain_extent(x, rel, len, *gte);
    // Following grains of the same grain table and window, while they continue e.
    uint64_t slice = *at / kGtWindow;
    while (e.length < len && (rel + e.length) % x.gd_coverage != 0) {
      uint64_t next_at = *at + ((rel + e.length) / x.grain_bytes - rel / x.grain_bytes) * 4;
      if (next_at / kGtWindow != slice) break;
      auto g = entry(x, next_at, ref);
      if (!g) break;
      Extent n = grain_extent(x, rel + e.length, len - e.length, *g);
      if (!extends(e, n)) break;
      e.length += n.length;
    }
    return std::optional<Extent>(e);
  }

  std::string path_;
  std::vector<VExtent> extents_;
  std::vector<HostFileState> files_;
};

// The map over `extents` (sorted, consecutive, non-empty); `files` hold the
// caches the extents point at (their HostFiles outlive the map).
std::unique_ptr<VmdkMap> make_map(std::string path, std::vector<VExtent> extents, std::vector<HostFileState> files);

}  // namespace qcowfs::image::vmdk
