// Test-only editing of VHDX metadata for the VHDX unit tests: the C++
// counterpart of tests/qcowfs_testlib/vhdx_edit.py (which the Python hostile
// corpus and integration tests keep using), so that no C++ test runs Python.
// An Editor holds a whole image file in memory (images made by qemu-img) and
// pokes BAT entries, region-table entries, header fields (checksum fixed up)
// and metadata items, and writes log entries. Layouts and constants come from
// image/vhdx/format.h, checksums from image/vhdx/crc32c.h (the driver's CRC-32C,
// itself tested against known vectors). Log entries are encoded here, not by
// the driver's log writer, so the tests that replay them stay independent of it.
// Misuse (a region or item the image lacks) is reported as a gtest failure.
// Thread-safety: none; one test uses one Editor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "image/vhdx/format.h"

namespace qcowfs::image::vhdx::testing {

using Bytes = std::vector<std::byte>;

// One 4 KiB sector that a log entry writes at file_offset.
struct LogWrite {
  uint64_t file_offset = 0;
  Bytes data;  // kLogSectorSize bytes
};

// A log entry of sequence `sequence` with one data descriptor and data sector
// per write, checksum over the whole entry (vhdx_edit.py's log_entry).
Bytes log_entry(const Guid& log_guid, uint64_t sequence, const std::vector<LogWrite>& writes,
                uint64_t flushed_file_offset, uint64_t last_file_offset, uint32_t tail = 0);

// Stores the CRC-32C of `block`, computed with the field at `at` zeroed, at `at`.
void fix_checksum(std::span<std::byte> block, size_t at = 4);

// A BAT entry naming `file_offset` (rounded down to a MiB) in `state`.
inline uint64_t bat_entry(uint64_t state, uint64_t file_offset) { return (file_offset & kBatOffsetMask) | state; }

class Editor {
 public:
  explicit Editor(Bytes image) : image_(std::move(image)) {}
  static Editor load(const std::string& path);
  void save(const std::string& path) const;
  const Bytes& bytes() const { return image_; }

  // Raw access; reads past the end give zeros, writes past it grow the image.
  Bytes read(uint64_t off, size_t len) const;
  void write(uint64_t off, std::span<const std::byte> data);

  // Headers (index 0 at 64 KiB, 1 at 128 KiB).
  uint64_t sequence_number(int index) const;
  uint64_t log_offset(int index) const;
  // The header QEMU uses when both are valid: the larger sequence number.
  int current_header_index() const;
  // Sets the log GUID of header `index` and fixes its checksum.
  void set_log_guid(int index, const Guid& guid);

  // Region table (the first one, the one QEMU reads).
  uint64_t region_offset(const Guid& region) const;
  uint64_t bat_offset() const { return region_offset(kBatGuid); }
  uint64_t metadata_offset() const { return region_offset(kMetadataGuid); }
  // Sets a region entry's length and fixes the table's checksum.
  void set_region_length(const Guid& region, uint32_t length);

  // Metadata items.
  uint64_t metadata_item_offset(const Guid& item) const;  // file offset of the item's value
  uint32_t metadata_u32(const Guid& item) const;
  void set_metadata_u32(const Guid& item, uint32_t value);
  uint32_t block_size() const { return metadata_u32(kFileParametersGuid); }

  // BAT (512-byte logical sectors).
  uint64_t chunk_ratio() const;
  uint64_t bat_index(uint64_t block) const;  // payload block -> BAT index (bitmap entries interleaved)
  uint64_t bat(uint64_t index) const;
  void set_bat(uint64_t index, uint64_t value);
  // Sets the state bits of BAT entry `index`, keeping its offset.
  void set_bat_state(uint64_t index, uint64_t state);

  // Leaves the image as a writer killed after its log write: a valid entry
  // for `writes` at the start of the log (flushed and last file offset = the
  // file's size) and the current header naming a new log GUID, returned.
  Guid write_pending_log(const std::vector<LogWrite>& writes, uint64_t sequence = 1);

 private:
  uint64_t le64(uint64_t off) const;
  uint32_t le32(uint64_t off) const;
  size_t region_entry_at(const Guid& region) const;  // offset of the entry in the table

  Bytes image_;
};

}  // namespace qcowfs::image::vhdx::testing
