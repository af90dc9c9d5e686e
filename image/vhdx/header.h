// Parsing the VHDX header section and metadata from bytes already read: the
// current header (QEMU's vhdx_parse_header), the region table
// (vhdx_open_region_tables), the metadata table (vhdx_parse_metadata) and the
// geometry they give (block size, chunk ratio, BAT entries, virtual size).
// Pure functions over spans; every failure is a Status naming the file and
// the field. Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "image/vhdx/format.h"
#include "io/status.h"

namespace qcowfs::image::vhdx {

// The 16 GUID bytes at p, as they are in the file.
Guid load_guid(const std::byte* p);

// EIO for a read-write open of an image a write could spoil: "PATH: WHAT;
// qcowfs does not write to this VHDX image (mount it read-only)".
Status refuse_writable(const std::string& path, const std::string& what);

struct Header {
  int index = 0;  // 0: the header at 64 KiB, 1: at 128 KiB
  uint64_t sequence_number = 0;
  Guid log_guid{};
  uint16_t log_version = 0;
  uint32_t log_length = 0;
  uint64_t log_offset = 0;
  bool has_log_guid() const;
};

// [start, end) of one structure in the file; QEMU refuses regions that
// overlap (vhdx_region_check), with its unsigned arithmetic (end may wrap).
struct FileRange {
  uint64_t start = 0;
  uint64_t end = 0;
};
bool overlaps_any(const std::vector<FileRange>& ranges, uint64_t start, uint64_t length);

struct Region {
  uint64_t offset = 0;
  uint32_t length = 0;
};

struct Regions {
  Region bat;
  Region metadata;
  std::vector<FileRange> used;  // the log and every region table entry
};

// Where each metadata item's value is (host offsets).
struct MetadataItems {
  uint64_t file_parameters = 0;
  uint64_t virtual_disk_size = 0;
  uint64_t logical_sector_size = 0;
  uint64_t physical_sector_size = 0;
};

// The metadata item values.
struct Parameters {
  uint32_t block_size = 0;
  uint32_t flags = 0;
  uint64_t virtual_disk_size = 0;
  uint32_t logical_sector_size = 0;
  uint32_t physical_sector_size = 0;
};

struct Geometry {
  uint32_t block_size = 0;
  uint64_t chunk_ratio = 0;  // payload entries per sector-bitmap entry
  uint32_t bat_entries = 0;  // QEMU's count (vhdx_calc_bat_entries), uint32 arithmetic included
  uint64_t size = 0;         // guest bytes: the virtual disk size rounded down to 512
  uint32_t physical_sector_size = 0;
  // The BAT index of the payload block holding guest byte `guest`.
  uint64_t bat_index(uint64_t guest) const;
};

// The current header of the two 4 KiB header blocks h1 (64 KiB) and h2 (128 KiB).
Result<Header> choose_header(std::span<const std::byte> h1, std::span<const std::byte> h2, const std::string& path);

// The BAT and metadata regions of the 64 KiB region table; `log` is the
// current header (its log region counts for the overlap check).
Result<Regions> parse_region_table(std::span<const std::byte> table, const Header& log, const std::string& path);

// The item locations of the 64 KiB metadata table at host offset region_offset.
Result<MetadataItems> parse_metadata_table(std::span<const std::byte> table, uint64_t region_offset,
                                           const std::string& path);

// Checks the parameters as QEMU does (and the 64 TiB size limit) and derives
// the geometry; bat_region_length is the BAT region's length.
Result<Geometry> make_geometry(const Parameters& p, uint32_t bat_region_length, const std::string& path);

}  // namespace qcowfs::image::vhdx
