// Parallels disk images on disk: QEMU's docs/interop/parallels.txt, as QEMU
// 7.2's block/parallels.c and parallels-ext.c read them. Little-endian. A
// 64-byte header, then the BAT (one 32-bit entry a cluster, 0 = unallocated)
// from offset 64. An entry times the offset multiplier is the cluster's first
// host sector: the multiplier is the cluster size in sectors ("tracks") for
// "WithouFreSpacExt" images and 1 for the old "WithoutFreeSpace" ones.
// Thread-safety: constants only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace qcowfs::image::parallels {

inline constexpr uint64_t kSector = 512;

inline constexpr size_t kHeaderSize = 64;
inline constexpr std::string_view kMagicOld = "WithoutFreeSpace";  // BAT entries in sectors
inline constexpr std::string_view kMagicExt = "WithouFreSpacExt";  // BAT entries in clusters
inline constexpr size_t kMagicOff = 0;        // char[16]
inline constexpr size_t kVersionOff = 16;     // le32: kVersion
inline constexpr size_t kHeadsOff = 20;       // le32 (geometry, unused)
inline constexpr size_t kCylindersOff = 24;   // le32 (geometry, unused)
inline constexpr size_t kTracksOff = 28;      // le32: sectors a cluster
inline constexpr size_t kBatEntriesOff = 32;  // le32
inline constexpr size_t kNbSectorsOff = 36;   // le64 (the old magic uses its low 32 bits)
inline constexpr size_t kInuseOff = 44;       // le32: kInuseMagic while open read-write
inline constexpr size_t kDataOffOff = 48;     // le32: first data sector
inline constexpr size_t kFlagsOff = 52;       // le32
inline constexpr size_t kExtOffOff = 56;      // le64: format extension cluster, in sectors; 0: none
inline constexpr size_t kBatOff = kHeaderSize;

inline constexpr uint32_t kVersion = 2;
inline constexpr uint32_t kInuseMagic = 0x746F6E59;

// The format extension cluster (parallels-ext.c): a header (magic, MD5 of the
// rest of the cluster), then features, each a 24-byte header (magic, flags,
// data size) and its data padded to 8 bytes, until the end-of-features magic.
inline constexpr uint64_t kExtMagic = 0xAB234CEF23DCEA87ull;
inline constexpr size_t kExtHeaderSize = 24;
inline constexpr uint64_t kFeatureEnd = 0;
inline constexpr uint64_t kFeatureDirtyBitmap = 0x20385FAE252CB34Aull;
inline constexpr size_t kFeatureHeaderSize = 24;
inline constexpr size_t kFeatureDataSizeOff = 16;  // le32 (flags, le64 at 8, must be 0)
// A dirty bitmap feature's data: size in sectors (le64), id[16], granularity
// (le32), l1_size (le32), then l1_size le64 entries.
inline constexpr size_t kBitmapFeatureSize = 32;
inline constexpr size_t kBitmapL1SizeOff = 28;

// QEMU 7.2's limits (parallels_open).
inline constexpr uint64_t kMaxTracks = 0x7fffffff / 513;     // "Too big cluster"
inline constexpr uint64_t kMaxBatEntries = 0x7fffffff / 4;   // "Catalog too large"
// QEMU reads the header and BAT (rounded up to the 4 KiB buffer alignment) in
// one request, which fails (EIO) past BDRV_REQUEST_MAX_BYTES.
inline constexpr uint64_t kMaxHeaderRead = 0x7ffffe00;
inline constexpr uint64_t kHeaderReadAlign = 4096;

// qcowfs's own bounds: the BAT entries kept in memory (those inside the file;
// entries past its end read as 0 in QEMU, i.e. unallocated): 2^25, a 128 MiB
// table; the bytes of the format extension cluster it parses (and hashes at
// a time); the largest extension cluster it checksums (qemu-img's clusters
// are 1 MiB; QEMU's own limit is 2 GiB).
inline constexpr uint64_t kMaxBatInMemory = 1ull << 25;
inline constexpr uint64_t kMaxExtRead = 1ull << 20;
inline constexpr uint64_t kMaxExtCluster = 64ull << 20;

}  // namespace qcowfs::image::parallels
