// VHD (QEMU's "vpc" driver) on disk: Microsoft's "Virtual Hard Disk Image
// Format Specification", as QEMU 7.2's block/vpc.c reads it. Everything is
// big-endian. A 512-byte footer ("conectix") ends the file; a dynamic disk
// keeps a copy at offset 0 and a 1024-byte dynamic-disk header ("cxsparse")
// at the footer's data_offset, which names the block allocation table (BAT):
// one 32-bit sector number per block, 0xFFFFFFFF for an unallocated block.
// Each allocated block is its sector bitmap followed by block_size bytes.
// Thread-safety: constants and pure functions only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace qcowfs::image::vpc {

inline constexpr uint64_t kSector = 512;

// The footer (also the copy at offset 0 of a dynamic disk).
inline constexpr size_t kFooterSize = 512;
inline constexpr std::string_view kFooterCookie = "conectix";
inline constexpr size_t kFooterCookieOff = 0;        // char[8]
inline constexpr size_t kFooterDataOffsetOff = 16;   // be64: the dynamic-disk header
inline constexpr size_t kFooterCreatorAppOff = 28;   // char[4]: "vpc ", "qemu", "qem2", "win ", ...
inline constexpr size_t kFooterCurrentSizeOff = 48;  // be64: bytes
inline constexpr size_t kFooterCylsOff = 56;         // be16
inline constexpr size_t kFooterHeadsOff = 58;        // u8
inline constexpr size_t kFooterSecsOff = 59;         // u8: sectors per track
inline constexpr size_t kFooterTypeOff = 60;         // be32: kFixed, kDynamic, kDifferencing
inline constexpr size_t kFooterChecksumOff = 64;     // be32: ~(sum of the other bytes)

// Disk types (footer type field).
inline constexpr uint32_t kFixed = 2;
inline constexpr uint32_t kDynamic = 3;
inline constexpr uint32_t kDifferencing = 4;

// The dynamic-disk header.
inline constexpr size_t kDynHeaderSize = 1024;
inline constexpr std::string_view kDynCookie = "cxsparse";
inline constexpr size_t kDynCookieOff = 0;           // char[8]
inline constexpr size_t kDynTableOffsetOff = 16;     // be64: the BAT
inline constexpr size_t kDynMaxTableEntriesOff = 28; // be32
inline constexpr size_t kDynBlockSizeOff = 32;       // be32: a power of two, >= 512

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
// New blocks qcowfs allocates keep their data 4 KiB-aligned in the file (a
// 512-byte bitmap would put every block's data off the host's 4 KiB blocks,
// and filesystems serialize unaligned direct I/O: ext4 wrote 1 MiB extending
// writes 4.6x slower 512 bytes off): the block starts 4 KiB-aligned with
// kNewBlockAlign - bitmap_size bytes of zeros, then the bitmap the BAT entry
// names, then the data. The spec lets blocks start at any sector; QEMU, which
// puts a new block where the footer was, reads such images as any other.
inline constexpr uint64_t kNewBlockAlign = 4096;
// The zeros before a new block's bitmap (none when the block size keeps no
// 4 KiB alignment anyway).
constexpr uint64_t new_block_pad(uint64_t block_size) {
  const uint64_t bitmap = bitmap_size(block_size);
  if (block_size % kNewBlockAlign != 0) return 0;
  return (kNewBlockAlign - bitmap % kNewBlockAlign) % kNewBlockAlign;
}

}  // namespace qcowfs::image::vpc
