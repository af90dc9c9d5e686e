#include "image/vhdx/header.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <optional>

#include "image/endian.h"
#include "image/vhdx/crc32c.h"

namespace qcowfs::image::vhdx {
Guid load_guid(const std::byte* p) {
  Guid g;
  std::memcpy(g.data(), p, g.size());
  return g;
}

Status refuse_writable(const std::string& path, const std::string& what) {
  return Status::errorf(EIO, "{}: {}; qcowfs does not write to this VHDX image (mount it read-only)", path, what);
}

namespace {

bool checksum_ok(std::span<const std::byte> block) {
  return crc32c_with_zeroed_field(block, 4) == load_le32(block.data() + 4);
}

// A header block that QEMU accepts: checksum, signature "head", version 1.
std::optional<Header> valid_header(std::span<const std::byte> b, int index) {
  if (b.size() < kHeaderSize || !checksum_ok(b.first(kHeaderSize))) return std::nullopt;
  namespace f = header_field;
  if (load_le32(b.data() + f::kSignature) != kHeaderSignature) return std::nullopt;
  if (load_le16(b.data() + f::kVersion) != kHeaderVersion) return std::nullopt;
  Header h;
  h.index = index;
  h.sequence_number = load_le64(b.data() + f::kSequenceNumber);
  h.log_guid = load_guid(b.data() + f::kLogGuid);
  h.log_version = load_le16(b.data() + f::kLogVersion);
  h.log_length = load_le32(b.data() + f::kLogLength);
  h.log_offset = load_le64(b.data() + f::kLogOffset);
  return h;
}

struct MetadataSeen {
  std::optional<uint32_t> file_parameters, virtual_disk_size, page83, logical, physical, parent_locator;
};

std::optional<uint32_t>* slot_for(MetadataSeen& seen, const Guid& g) {
  if (g == kFileParametersGuid) return &seen.file_parameters;
  if (g == kVirtualDiskSizeGuid) return &seen.virtual_disk_size;
  if (g == kPage83Guid) return &seen.page83;
  if (g == kLogicalSectorSizeGuid) return &seen.logical;
  if (g == kPhysicalSectorSizeGuid) return &seen.physical;
  if (g == kParentLocatorGuid) return &seen.parent_locator;
  return nullptr;
}

Status missing_item(const std::string& path, const MetadataSeen& s) {
  const char* name = !s.file_parameters     ? "file parameters"
                     : !s.virtual_disk_size ? "virtual disk size"
                     : !s.page83            ? "page 83 data"
                     : !s.logical           ? "logical sector size"
                                            : "physical sector size";
  return Status::errorf(ENOTSUP, "{}: the VHDX metadata table has no {} item", path, name);
}

bool is_power_of_two(uint64_t v) { return v != 0 && (v & (v - 1)) == 0; }

}  // namespace

bool Header::has_log_guid() const { return log_guid != Guid{}; }

bool overlaps_any(const std::vector<FileRange>& ranges, uint64_t start, uint64_t length) {
  const uint64_t end = start + length;
  return std::any_of(ranges.begin(), ranges.end(),
                     [&](const FileRange& r) { return !(start >= r.end || end <= r.start); });
}

uint64_t Geometry::bat_index(uint64_t guest) const {
  const uint64_t block = guest / block_size;
  return block + block / chunk_ratio;
}

Result<Header> choose_header(std::span<const std::byte> h1, std::span<const std::byte> h2, const std::string& path) {
  auto a = valid_header(h1, 0);
  auto b = valid_header(h2, 1);
  if (!a && !b)
    return Status::errorf(EINVAL, "{}: no valid VHDX header (both headers fail their checksum, signature or version)",
                          path);
  if (a && !b) return *a;
  if (b && !a) return *b;
  if (a->sequence_number > b->sequence_number) return *a;
  if (b->sequence_number > a->sequence_number) return *b;
  // Disk2VHD writes two identical headers; QEMU takes the first then.
  if (std::memcmp(h1.data(), h2.data(), header_field::kEnd) == 0) return *a;
  return Status::errorf(EINVAL, "{}: no valid VHDX header (both headers have sequence number {} but differ)", path,
                        a->sequence_number);
}

Result<Regions> parse_region_table(std::span<const std::byte> t, const Header& log, const std::string& path) {
  if (t.size() < kRegionTableSize || !checksum_ok(t.first(kRegionTableSize)))
    return Status::errorf(EINVAL, "{}: the VHDX region table at {:#x} fails its checksum", path, kRegionTableOffset);
  if (load_le32(t.data()) != kRegionSignature)
    return Status::errorf(EINVAL, "{}: the VHDX region table has no 'regi' signature", path);
  const uint32_t count = load_le32(t.data() + kRegionEntryCountAt);
  if (count > kMaxRegionEntries)
    return Status::errorf(EINVAL, "{}: the VHDX region table has {} entries (at most {})", path, count,
                          kMaxRegionEntries);
  Regions r;
  r.used.push_back(FileRange{log.log_offset, log.log_offset + log.log_length});
  bool bat = false, metadata = false;
  for (uint32_t i = 0; i < count; ++i) {
    const std::byte* e = t.data() + kRegionHeaderSize + size_t{i} * kRegionEntrySize;
    const Guid g = load_guid(e);
    const Region region{load_le64(e + 16), load_le32(e + 24)};
    if (overlaps_any(r.used, region.offset, region.length))
      return Status::errorf(EINVAL, "{}: VHDX region {} at {:#x} (+{:#x}) overlaps the log or another region", path, i,
                            region.offset, region.length);
    r.used.push_back(FileRange{region.offset, region.offset + region.length});
    if (g != kBatGuid && g != kMetadataGuid) {
      if (load_le32(e + 28) & kRegionRequired)
        return Status::errorf(ENOTSUP, "{}: VHDX region {} is required but unknown", path, i);
      continue;
    }
    const bool is_bat = g == kBatGuid;
    bool& seen = is_bat ? bat : metadata;
    if (seen)
      return Status::errorf(EINVAL, "{}: the VHDX region table names the {} region twice", path,
                            is_bat ? "BAT" : "metadata");
    seen = true;
    (is_bat ? r.bat : r.metadata) = region;
  }
  if (!bat || !metadata)
    return Status::errorf(EINVAL, "{}: the VHDX region table has no {} region", path, bat ? "metadata" : "BAT");
  return r;
}

Result<MetadataItems> parse_metadata_table(std::span<const std::byte> t, uint64_t region_offset,
                                           const std::string& path) {
  if (t.size() < kMetadataTableSize || load_le64(t.data()) != kMetadataSignature)
    return Status::errorf(EINVAL, "{}: the VHDX metadata table at {:#x} has no 'metadata' signature", path,
                          region_offset);
  const uint16_t count = load_le16(t.data() + kMetadataEntryCountAt);
  if (size_t{count} * kMetadataEntrySize > kMetadataTableSize - kMetadataHeaderSize)
    return Status::errorf(EINVAL, "{}: the VHDX metadata table has {} entries (at most 2047)", path, count);
  MetadataSeen seen;
  for (uint32_t i = 0; i < count; ++i) {
    const std::byte* e = t.data() + kMetadataHeaderSize + size_t{i} * kMetadataEntrySize;
    std::optional<uint32_t>* slot = slot_for(seen, load_guid(e));
    if (slot == nullptr) {
      if (load_le32(e + 24) & kMetadataRequired)
        return Status::errorf(ENOTSUP, "{}: VHDX metadata item {} is required but unknown", path, i);
      continue;
    }
    if (slot->has_value()) return Status::errorf(EINVAL, "{}: VHDX metadata item {} appears twice", path, i);
    *slot = load_le32(e + 16);
  }
  if (seen.parent_locator)
    return Status::errorf(ENOTSUP, "{}: differencing VHDX images (with a parent locator) are not supported", path);
  if (!seen.file_parameters || !seen.virtual_disk_size || !seen.page83 || !seen.logical || !seen.physical)
    return missing_item(path, seen);
  return MetadataItems{region_offset + *seen.file_parameters, region_offset + *seen.virtual_disk_size,
                       region_offset + *seen.logical, region_offset + *seen.physical};
}

Result<Geometry> make_geometry(const Parameters& p, uint32_t bat_region_length, const std::string& path) {
  if (p.flags & kHasParent)
    return Status::errorf(EINVAL, "{}: the VHDX file parameters say has_parent but there is no parent locator", path);
  if (p.block_size < kMinBlockSize || p.block_size > kMaxBlockSize || !is_power_of_two(p.block_size))
    return Status::errorf(EINVAL, "{}: VHDX block size {} is not a power of two from 1 MiB to 256 MiB", path,
                          p.block_size);
  if (p.logical_sector_size != kLogicalSectorSize)
    return Status::errorf(ENOTSUP, "{}: VHDX logical sector size {} is not supported (QEMU 7.2 opens 512 only)", path,
                          p.logical_sector_size);
  if (p.virtual_disk_size > kMaxVirtualSize)
    return Status::errorf(EINVAL, "{}: VHDX virtual disk size {} is larger than 64 TiB", path, p.virtual_disk_size);
  Geometry g;
  g.block_size = p.block_size;
  g.chunk_ratio = kMaxSectorsPerBlock * kLogicalSectorSize / p.block_size;
  g.size = p.virtual_disk_size / kLogicalSectorSize * kLogicalSectorSize;
  g.physical_sector_size = p.physical_sector_size;
  // QEMU's uint32 arithmetic: a zero-sized disk wraps (data_blocks - 1).
  const auto data_blocks = static_cast<uint32_t>((p.virtual_disk_size + p.block_size - 1) / p.block_size);
  const auto bitmap_gap = static_cast<uint32_t>(data_blocks - 1) >> std::countr_zero(g.chunk_ratio);
  g.bat_entries = data_blocks + bitmap_gap;
  if (g.bat_entries > bat_region_length / kBatEntrySize)
    return Status::errorf(EINVAL, "{}: the VHDX BAT region ({} bytes) is too small for {} entries", path,
                          bat_region_length, g.bat_entries);
  return g;
}

}  // namespace qcowfs::image::vhdx
