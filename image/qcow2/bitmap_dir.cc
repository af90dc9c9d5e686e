#include "image/qcow2/bitmap_dir.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <unordered_set>

#include "image/endian.h"
#include "io/align.h"

namespace qcowfs::image::qcow2 {
namespace {

Status dir_invalid(std::string what) { return Status::error(EINVAL, std::move(what)); }

// QEMU's check_dir_entry: the entry's own fields against its limits and, for a
// bitmap not in use, a table large enough for the disk.
bool entry_satisfies_constraints(const BitmapDirEntry& e, uint8_t type, uint32_t cluster_bits, uint64_t disk_size) {
  const uint64_t cs = uint64_t{1} << cluster_bits;
  if (e.table_size == 0 || e.table_offset == 0 || (e.table_offset & (cs - 1)) != 0 ||
      e.table_size > kBitmapMaxTableSize || e.granularity_bits > kBitmapMaxGranularityBits ||
      e.granularity_bits < kBitmapMinGranularityBits || (e.flags & kBitmapReservedFlags) != 0 ||
      e.name.size() > kBitmapMaxNameSize || type != kBitmapTypeDirtyTracking)
    return false;
  const uint64_t phys_bytes = uint64_t{e.table_size} << cluster_bits;
  if (phys_bytes > kBitmapMaxPhysBytes) return false;
  // phys_bytes <= 2^29 and granularity_bits <= 31: the product fits in 64 bits.
  return e.in_use() || disk_size <= ((phys_bytes * 8) << e.granularity_bits);
}

}  // namespace

uint64_t bitmap_bits(uint64_t disk_size, uint32_t granularity_bits) {
  return div_round_up(disk_size, uint64_t{1} << granularity_bits);
}

uint64_t bitmap_table_entries(uint64_t disk_size, uint32_t granularity_bits, uint32_t cluster_bits) {
  const uint64_t bytes = div_round_up(bitmap_bits(disk_size, granularity_bits), uint64_t{8});
  return div_round_up(bytes, uint64_t{1} << cluster_bits);
}

uint64_t bitmap_dir_entry_bytes(const std::string& name) {
  return align_up(sizeof(BitmapDirEntryLayout) + name.size(), kBitmapDirEntryAlign);
}

Status check_new_bitmap(uint64_t disk_size, uint32_t cluster_bits, const std::string& name, uint64_t granularity) {
  if (granularity == 0 || (granularity & (granularity - 1)) != 0)
    return dir_invalid("Granularity must be power of 2");
  const auto bits = static_cast<uint32_t>(std::countr_zero(granularity));
  if (bits > kBitmapMaxGranularityBits)
    return dir_invalid(fmt::format("Granularity exceeds maximum ({} bytes)", uint64_t{1} << kBitmapMaxGranularityBits));
  if (bits < kBitmapMinGranularityBits)
    return dir_invalid(fmt::format("Granularity is under minimum ({} bytes)", uint64_t{1} << kBitmapMinGranularityBits));
  const uint64_t bytes = div_round_up(bitmap_bits(disk_size, bits), uint64_t{8});
  if (bytes > kBitmapMaxPhysBytes || bytes > (uint64_t{kBitmapMaxTableSize} << cluster_bits))
    return dir_invalid("Too much space will be occupied by the bitmap. Use larger granularity");
  if (name.size() > kBitmapMaxNameSize)
    return dir_invalid(fmt::format("Name length exceeds maximum ({} characters)", kBitmapMaxNameSize));
  return Status::ok();
}

Result<std::vector<BitmapDirEntry>> parse_bitmap_dir(std::span<const std::byte> dir, uint32_t nb_bitmaps,
                                                     uint32_t cluster_bits, uint64_t disk_size, uint64_t file_size) {
  if (dir.empty()) return dir_invalid("Requested bitmap directory size is zero");
  if (dir.size() > kMaxBitmapDirectorySize) return dir_invalid("Requested bitmap directory size is too big");
  std::vector<BitmapDirEntry> out;
  std::unordered_set<std::string> names;
  uint64_t pos = 0;
  while (pos < dir.size()) {
    if (dir.size() - pos < sizeof(BitmapDirEntryLayout)) return dir_invalid("Broken bitmap directory");
    if (out.size() >= nb_bitmaps) return dir_invalid("More bitmaps found than specified in header extension");
    const std::byte* p = dir.data() + pos;
    const uint16_t name_size = load_be16(p + offsetof(BitmapDirEntryLayout, name_size));
    const uint32_t extra = load_be32(p + offsetof(BitmapDirEntryLayout, extra_data_size));
    const uint64_t entry = align_up(sizeof(BitmapDirEntryLayout) + uint64_t{extra} + name_size, kBitmapDirEntryAlign);
    if (entry > dir.size() - pos) return dir_invalid("Broken bitmap directory");
    if (extra != 0) return dir_invalid("Bitmap extra data is not supported");
    BitmapDirEntry e;
    e.table_offset = load_be64(p + offsetof(BitmapDirEntryLayout, bitmap_table_offset));
    e.table_size = load_be32(p + offsetof(BitmapDirEntryLayout, bitmap_table_size));
    e.flags = load_be32(p + offsetof(BitmapDirEntryLayout, flags));
    e.granularity_bits = static_cast<uint8_t>(p[offsetof(BitmapDirEntryLayout, granularity_bits)]);
    e.name.assign(reinterpret_cast<const char*>(p + sizeof(BitmapDirEntryLayout)), name_size);
    const auto type = static_cast<uint8_t>(p[offsetof(BitmapDirEntryLayout, type)]);
    if (!entry_satisfies_constraints(e, type, cluster_bits, disk_size))
      return dir_invalid(fmt::format("Bitmap '{}' doesn't satisfy the constraints", e.name));
    const uint64_t table_bytes = uint64_t{e.table_size} * kBitmapTableEntrySize;
    if (!e.in_use() && (e.table_offset < (uint64_t{1} << cluster_bits) || e.table_offset > file_size ||
                        table_bytes > file_size - e.table_offset))
      return dir_invalid(fmt::format("table of bitmap '{}' at {:#x} ({} entries) lies outside the file", e.name,
                                 e.table_offset, e.table_size));
    // QEMU: the second bitmap of a name "already exists" and the open fails.
    if (!names.insert(e.name).second) return dir_invalid(fmt::format("Duplicate bitmap name '{}'", e.name));
    out.push_back(std::move(e));
    pos += entry;
  }
  if (out.size() != nb_bitmaps) return dir_invalid("Less bitmaps found than specified in header extension");
  return out;
}

std::vector<std::byte> serialize_bitmap_dir(const std::vector<BitmapDirEntry>& entries) {
  uint64_t total = 0;
  for (const BitmapDirEntry& e : entries) total += bitmap_dir_entry_bytes(e.name);
  std::vector<std::byte> out(total);
  uint64_t pos = 0;
  for (const BitmapDirEntry& e : entries) {
    std::byte* p = out.data() + pos;
    store_be64(p + offsetof(BitmapDirEntryLayout, bitmap_table_offset), e.table_offset);
    store_be32(p + offsetof(BitmapDirEntryLayout, bitmap_table_size), e.table_size);
    store_be32(p + offsetof(BitmapDirEntryLayout, flags), e.flags);
    p[offsetof(BitmapDirEntryLayout, type)] = std::byte{kBitmapTypeDirtyTracking};
    p[offsetof(BitmapDirEntryLayout, granularity_bits)] = std::byte{e.granularity_bits};
    store_be16(p + offsetof(BitmapDirEntryLayout, name_size), static_cast<uint16_t>(e.name.size()));
    store_be32(p + offsetof(BitmapDirEntryLayout, extra_data_size), 0);
    std::memcpy(p + sizeof(BitmapDirEntryLayout), e.name.data(), e.name.size());
    pos += bitmap_dir_entry_bytes(e.name);
  }
  return out;
}

Result<std::vector<uint64_t>> parse_bitmap_table(std::span<const std::byte> table, const BitmapDirEntry& e,
                                                 uint32_t cluster_bits, uint64_t file_size) {
  const uint64_t cs = uint64_t{1} << cluster_bits;
  if (table.size() != uint64_t{e.table_size} * kBitmapTableEntrySize)
    return dir_invalid(fmt::format("table of bitmap '{}': {} bytes read for {} entries", e.name, table.size(),
                               e.table_size));
  std::vector<uint64_t> out(e.table_size);
  for (uint32_t i = 0; i < e.table_size; ++i) {
    const uint64_t v = load_be64(table.data() + uint64_t{i} * kBitmapTableEntrySize);
    const uint64_t host = v & kBitmapTableOffsetMask;
    const bool bad = (v & kBitmapTableReservedMask) != 0 ||
                     (host != 0 && ((v & kBitmapTableAllOnes) != 0 || (host & (cs - 1)) != 0));
    if (bad) return dir_invalid(fmt::format("table of bitmap '{}': entry {} ({:#x}) is invalid", e.name, i, v));
    if (host != 0 && (host < cs || host > file_size || cs > file_size - host))
      return dir_invalid(fmt::format("table of bitmap '{}': data cluster {:#x} lies outside the file", e.name, host));
    out[i] = v;
  }
  return out;
}

Status check_bitmap_ranges_disjoint(std::vector<BitmapHostRange> ranges) {
  std::erase_if(ranges, [](const BitmapHostRange& r) { return r.length == 0; });
  std::sort(ranges.begin(), ranges.end(),
            [](const BitmapHostRange& a, const BitmapHostRange& b) { return a.offset < b.offset; });
  for (size_t i = 1; i < ranges.size(); ++i) {
    const BitmapHostRange& a = ranges[i - 1];
    if (ranges[i].offset < a.offset + a.length)
      return dir_invalid(fmt::format("{} at {:#x} overlaps {} at {:#x}", ranges[i].what, ranges[i].offset, a.what,
                                 a.offset));
  }
  return Status::ok();
}

}  // namespace qcowfs::image::qcow2
