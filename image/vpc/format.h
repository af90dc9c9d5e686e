// VHD (QEMU's "vpc" driver) on disk: Microsoft's "Virtual Hard Disk Image
// Format Specification", as QEMU 7.2's block/vpc.c reads it. Everything is
// big-endian. A 512-byte footer ("conectix") ends the file; a dynamic disk
// keeps a copy at offset 0 and a 1024-byte dynamic-disk header ("cxsparse")
// at the footer's data_offset, which names the block allocation table (BAT):
// one 32-bit sector number per block, 0xFFFFFFFF for an unallocated block.
// Each allocated block is its sector bitmap followed by block_size bytes.
// Thread-safety: constants and pure functions only.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace qcowfs::image::vpc {

inline constexpr uint64_t kSector = 512;

// The footer (also the copy at offset 0 of a dynamic disk).
inline constexpr size_t kFooterSize = 512;
inline constexpr std::string_view kFooterCookie = "conectix";
inline constexpr size_t kFooterCookieOff = 0;        // char[8]
inline constexpr size_t kFooterFeaturesOff = 8;      // be32: 2 (reserved, always set)
inline constexpr size_t kFooterVersionOff = 12;      // be32: kFormatVersion
inline constexpr size_t kFooterDataOffsetOff = 16;   // be64: the dynamic-disk header (fixed: all ones)
inline constexpr size_t kFooterTimestampOff = 24;    // be32: seconds since 2000-01-01 UTC
inline constexpr size_t kFooterCreatorAppOff = 28;   // char[4]: "vpc ", "qemu", "qem2", "win ", ...
inline constexpr size_t kFooterCreatorVerOff = 32;   // be32: the creator's major << 16 | minor
inline constexpr size_t kFooterCreatorOsOff = 36;    // char[4]: "Wi2k", ...
inline constexpr size_t kFooterOrigSizeOff = 40;     // be64: bytes at creation
inline constexpr size_t kFooterCurrentSizeOff = 48;  // be64: bytes
inline constexpr size_t kFooterCylsOff = 56;         // be16
inline constexpr size_t kFooterHeadsOff = 58;        // u8
inline constexpr size_t kFooterSecsOff = 59;         // u8: sectors per track
inline constexpr size_t kFooterTypeOff = 60;         // be32: kFixed, kDynamic, kDifferencing
inline constexpr size_t kFooterChecksumOff = 64;     // be32: ~(sum of the other bytes)
inline constexpr size_t kFooterUuidOff = 68;         // 16 bytes

inline constexpr uint32_t kFooterFeatures = 2;
inline constexpr uint32_t kFormatVersion = 0x00010000;  // footer and dynamic-disk header version 1.0
inline constexpr uint64_t kTimestampBase = 946684800;   // 2000-01-01 UTC in Unix time

// Disk types (footer type field).
inline constexpr uint32_t kFixed = 2;
inline constexpr uint32_t kDynamic = 3;
inline constexpr uint32_t kDifferencing = 4;

// The dynamic-disk header.
inline constexpr size_t kDynHeaderSize = 1024;
inline constexpr std::string_view kDynCookie = "cxsparse";
inline constexpr size_t kDynCookieOff = 0;           // char[8]
inline constexpr size_t kDynDataOffsetOff = 8;       // be64: unused, all ones
inline constexpr size_t kDynTableOffsetOff = 16;     // be64: the BAT
inline constexpr size_t kDynVersionOff = 24;         // be32: kFormatVersion
inline constexpr size_t kDynMaxTableEntriesOff = 28; // be32
inline constexpr size_t kDynBlockSizeOff = 32;       // be32: a power of two, >= 512
inline constexpr size_t kDynChecksumOff = 36;        // be32: ~(sum of the other bytes)

inline constexpr uint32_t kBatUnallocated = 0xFFFFFFFF;

// Size limits, as QEMU 7.2 (block/vpc.c).
inline constexpr uint64_t kMaxGeometry = 65535ull * 16 * 255;  // VHD_MAX_GEOMETRY: CHS says "use current_size"
inline constexpr uint64_t kMaxSectors = 0xff000000;            // VHD_MAX_SECTORS: 2040 GiB
inline constexpr uint64_t kQemuMaxTableEntries = 0x7fffffff / 4;  // INT_MAX / 4

// qcowfs's own bound on the BAT it keeps in memory (4 bytes an entry): 2^25
// entries, a 128 MiB table, maps 2040 GiB with blocks of 64 KiB or more
// (qemu-img and Hyper-V use 2 MiB blocks: 1 MiB of BAT for 2040 GiB).
inline constexpr uint64_t kMaxTableEntries = 1ull << 25;

// The sector bitmap before each block: one bit a sector, in whole sectors.
constexpr uint64_t bitmap_size(uint64_t block_size) { return (block_size / (8 * kSector) + 511) & ~uint64_t{511}; }
// New blocks qcowfs allocates keep their data aligned in the file (a 512-byte
// bitmap would put every block's data off the host's 4 KiB blocks, and
// filesystems serialize unaligned direct I/O: ext4 wrote 1 MiB extending
// writes 4.6x slower 512 bytes off): a block starts on a new_block_align()
// boundary with new_block_pad() bytes of padding, then the bitmap the BAT
// entry names, then the data. The spec lets blocks start at any sector; QEMU,
// which puts a new block where the footer was, reads such images as any other.
// The alignment is 64 KiB, qcow2's cluster, for blocks of 2 MiB and more (1 MiB
// fills of 2 MiB blocks ran median 0.84x qcow2 with 4 KiB, 1.02-1.16x with
// 64 KiB and the padding a hole), 1/32 of a smaller block but at least 4 KiB,
// so that for blocks of 128 KiB and more the padding adds at most 3% to the
// file's length; VpcWriter leaves the padding unwritten where it can (a hole
// in a file). On a block device, whose capacity the padding would take, 4 KiB.
inline constexpr uint64_t kNewBlockAlignMin = 4096;
inline constexpr uint64_t kNewBlockAlignMax = 65536;
constexpr uint64_t new_block_align(uint64_t block_size, bool block_device) {
  if (block_device) return kNewBlockAlignMin;
  return std::clamp(block_size / 32, kNewBlockAlignMin, kNewBlockAlignMax);
}
// The padding before a new block's bitmap (none when the block size keeps no
// alignment anyway).
constexpr uint64_t new_block_pad(uint64_t block_size, uint64_t align) {
  const uint64_t bitmap = bitmap_size(block_size);
  if (block_size % align != 0) return 0;
  return (align - bitmap % align) % align;
}

}  // namespace qcowfs::image::vpc
