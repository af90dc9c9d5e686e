// VMDK on-disk constants and layouts (VMware "Virtual Disk Format 1.1", QEMU
// 7.2 block/vmdk.c): the "KDMV" sparse extent header (also the
// streamOptimized footer), the "COWD" VMFS sparse header, grain markers and
// the limits QEMU applies when it opens an extent. Everything is little-endian
// and counted in 512-byte sectors.
// Thread-safety: constants and pure functions.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

#include "io/status.h"

namespace qcowfs::image::vmdk {

constexpr uint64_t kSector = 512;

// Magic numbers, as the first four bytes of a file.
constexpr uint32_t kVmdk4MagicBe = 0x4b444d56;  // "KDMV"
constexpr uint32_t kVmdk3MagicBe = 0x434f5744;  // "COWD"

// KDMV header flags.
constexpr uint32_t kFlagNewlineDetect = 1u << 0;
constexpr uint32_t kFlagRedundantGd = 1u << 1;
constexpr uint32_t kFlagZeroGrain = 1u << 2;
constexpr uint32_t kFlagCompressed = 1u << 16;
constexpr uint32_t kFlagMarkers = 1u << 17;
constexpr uint16_t kCompressionDeflate = 1;
constexpr uint64_t kGdAtEnd = ~0ull;

// A grain-table entry of 1 is a zeroed grain when the header sets kFlagZeroGrain.
constexpr uint32_t kGteZeroed = 1;

// KDMV header, after the magic (byte offsets from the start of the file).
constexpr size_t kV4Version = 4, kV4Flags = 8, kV4Capacity = 12, kV4Granularity = 20, kV4DescOffset = 28,
                 kV4DescSize = 36, kV4NumGtes = 44, kV4RgdOffset = 48, kV4GdOffset = 56, kV4GrainOffset = 64,
                 kV4CheckBytes = 73, kV4Compress = 77, kV4HeaderEnd = 79;
// The check bytes "\n \r\n" (they show a file mangled by newline conversion).
constexpr std::array<uint8_t, 4> kV4CheckBytesValue = {0x0a, 0x20, 0x0d, 0x0a};

// COWD header, after the magic.
constexpr size_t kV3Version = 4, kV3Flags = 8, kV3DiskSectors = 12, kV3Granularity = 16, kV3L1Offset = 20,
                 kV3L1Size = 24, kV3HeaderEnd = 44;
constexpr uint32_t kV3GtesPerGt = 4096;

// Stream markers: {u64 value (LBA, or sectors of metadata), u32 size, u32 type
// (when size == 0)}; a grain marker's compressed data follows its size.
constexpr size_t kMarkerValue = 0, kMarkerSize = 8, kMarkerType = 12, kGrainMarkerHeader = 12;
constexpr uint32_t kMarkerEndOfStream = 0, kMarkerGrainTable = 1, kMarkerGrainDirectory = 2, kMarkerFooter = 3;
// GD at end: the footer marker, the footer header and the end-of-stream marker
// are the last three sectors (QEMU reads them 1536 bytes before the end).
constexpr uint64_t kFooterBytes = 3 * kSector;

// QEMU's limits (vmdk_add_extent, vmdk_open_vmdk4, vmdk_read_desc).
constexpr uint64_t kMaxGrainSectors = 0x200000;       // 1 GiB grains
// Ours: a compressed grain is inflated in memory (and read as two grains, as
// QEMU does), so compressed grains are at most 2 MiB (VMware writes 64 KiB).
constexpr uint64_t kMaxCompressedGrainSectors = 4096;
constexpr uint64_t kMaxGdEntries = 32ull * 1024 * 1024;
constexpr uint32_t kMaxGtesPerGt = 512;
constexpr uint32_t kMaxVersion = 3;
constexpr size_t kMaxDescriptorBytes = (1u << 20) - 1;  // what QEMU reads of a descriptor
constexpr size_t kDescWindow = 20 * kSector;            // where QEMU looks for CID and the parent hint
constexpr uint64_t kDescOffsetInSparse = 0x200;         // QEMU reads an embedded descriptor's CIDs there

// A sparse extent's header as QEMU uses it (KDMV or COWD).
struct SparseHeader {
  bool vmdk3 = false;
  uint32_t version = 0;
  uint32_t flags = 0;
  uint64_t capacity = 0;      // sectors
  uint64_t granularity = 0;   // grain size in sectors
  uint64_t desc_offset = 0;   // sectors
  uint64_t desc_size = 0;     // sectors
  uint32_t num_gtes_per_gt = 0;
  uint64_t rgd_offset = 0;    // sectors
  uint64_t gd_offset = 0;     // sectors
  uint64_t grain_offset = 0;  // sectors
  uint16_t compress_algorithm = 0;
  uint64_t gd_entries = 0;    // COWD: l1dir_size
};

// The header in the first bytes of an extent (at least kV4HeaderEnd bytes; a
// shorter span reads as zero-padded, as QEMU's reads past the end of a file).
SparseHeader parse_sparse_header(std::span<const std::byte> b);

// A KDMV header's bytes (magic, the fields above, the check bytes), as
// qemu-img create writes one (vmdk_init_extent); the rest of the sector is zero.
std::array<std::byte, kSector> serialize_sparse_header(const SparseHeader& h);

}  // namespace qcowfs::image::vmdk
