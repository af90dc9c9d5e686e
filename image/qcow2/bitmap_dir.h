// Persistent dirty bitmaps on disk (the qcow2 "bitmaps" extension): the
// bitmap directory and the bitmap tables, parsed and serialised. Parsing
// follows QEMU 7.2 (block/qcow2-bitmap.c: bitmap_list_load, check_dir_entry,
// check_table_entry, load_bitmap_data) and adds the bounds QEMU leaves to its
// block layer: every table and data cluster lies inside the file, out of the
// header cluster, and no two bitmap structures overlap. Anything else is
// EINVAL with a message saying which bitmap and what (QEMU's wording where it
// has one), never a crash and never an allocation sized by unchecked input.
// Thread-safety: plain values and pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "image/qcow2/format.h"
#include "io/status.h"

namespace qcowfs::image::qcow2 {

// One decoded directory entry (no extra data: QEMU refuses it).
struct BitmapDirEntry {
  std::string name;
  HostOffset table_offset = 0;
  uint32_t table_size = 0;  // entries
  uint32_t flags = 0;       // kBitmapFlagInUse | kBitmapFlagAuto
  uint8_t granularity_bits = 16;

  uint64_t granularity() const { return uint64_t{1} << granularity_bits; }
  bool in_use() const { return (flags & kBitmapFlagInUse) != 0; }
  bool enabled() const { return (flags & kBitmapFlagAuto) != 0; }
};

// A host byte range held by a bitmap structure.
struct BitmapHostRange {
  HostOffset offset = 0;
  uint64_t length = 0;
  std::string what;  // "bitmap directory", "table of bitmap 'b0'", ...
};

// Bits of a bitmap covering disk_size bytes at this granularity.
uint64_t bitmap_bits(uint64_t disk_size, uint32_t granularity_bits);
// Entries of its bitmap table: one data cluster holds cluster_size * 8 bits.
uint64_t bitmap_table_entries(uint64_t disk_size, uint32_t granularity_bits, uint32_t cluster_bits);
// Bytes of the directory entry of a bitmap named `name` (8-byte aligned).
uint64_t bitmap_dir_entry_bytes(const std::string& name);

// QEMU's check_constraints_on_bitmap for a new bitmap: granularity bounds,
// bitmap size, name length. The message is QEMU's.
Status check_new_bitmap(uint64_t disk_size, uint32_t cluster_bits, const std::string& name, uint64_t granularity);

// Parses the directory (nb_bitmaps entries filling `dir` exactly) of an image
// with these cluster bits and disk size, in a file of file_size bytes.
Result<std::vector<BitmapDirEntry>> parse_bitmap_dir(std::span<const std::byte> dir, uint32_t nb_bitmaps,
                                                     uint32_t cluster_bits, uint64_t disk_size, uint64_t file_size);

// The directory bytes of `entries` (QEMU's layout, no extra data).
std::vector<std::byte> serialize_bitmap_dir(const std::vector<BitmapDirEntry>& entries);

// Decodes and checks the table of `e` (table_size big-endian entries): QEMU's
// entry rules, data clusters inside the file and out of the header cluster.
Result<std::vector<uint64_t>> parse_bitmap_table(std::span<const std::byte> table, const BitmapDirEntry& e,
                                                 uint32_t cluster_bits, uint64_t file_size);

// EINVAL naming both structures when two of `ranges` overlap.
Status check_bitmap_ranges_disjoint(std::vector<BitmapHostRange> ranges);

}  // namespace qcowfs::image::qcow2
