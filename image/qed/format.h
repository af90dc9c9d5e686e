// QED on-disk format constants and the header layout (QEMU docs/interop/qed_spec.txt,
// block/qed.h). Every field is little-endian on disk and is read with
// image/endian.h at offsetof(...), never through the struct.
// Thread-safety: constants only.
//
// Vocabulary, used by every file under image/qed/:
//   guest offset  a byte offset in the virtual disk (`guest`)
//   host offset   a byte offset in the image file (`host`)
//   L1 / L2 entry a 64-bit host offset: of an L2 table (L1), of a data
//                 cluster (L2); 0 = unallocated, 1 = zero cluster (L2 only)
#pragma once

#include <cstddef>
#include <cstdint>

namespace qcowfs::image::qed {

inline constexpr uint32_t kMagic = 0x00444551;  // "QED\0"

// Feature bits (QED_F_*).
inline constexpr uint64_t kFeatureBackingFile = 0x01;
inline constexpr uint64_t kFeatureNeedCheck = 0x02;          // QED's dirty bit
inline constexpr uint64_t kFeatureBackingFormatNoProbe = 0x04;  // the backing file is raw
inline constexpr uint64_t kFeatureMask = kFeatureBackingFile | kFeatureNeedCheck | kFeatureBackingFormatNoProbe;

inline constexpr uint32_t kMinClusterSize = 4 * 1024;
inline constexpr uint32_t kMaxClusterSize = 64 * 1024 * 1024;
inline constexpr uint32_t kMinTableSize = 1;   // in clusters
inline constexpr uint32_t kMaxTableSize = 16;  // in clusters

// QEMU's image size granule (BDRV_SECTOR_SIZE).
inline constexpr uint64_t kSectorSize = 512;
// QEMU keeps the backing file name in a PATH_MAX buffer with its NUL.
inline constexpr uint32_t kBackingNameBuffer = 4096;

// L2 entries with a special meaning.
inline constexpr uint64_t kUnallocated = 0;
inline constexpr uint64_t kZeroCluster = 1;

// Our limit on the L1 entries read at open (8 bytes each): the largest L1
// that a size QEMU accepts can need is 2^21 entries (16 MiB, 1 MiB clusters,
// 16-cluster tables); anything bigger is refused before it is allocated.
inline constexpr uint64_t kMaxL1Bytes = 32ull << 20;

struct HeaderLayout {
  uint32_t magic;
  uint32_t cluster_size;  // bytes
  uint32_t table_size;    // clusters, for L1 and L2 tables
  uint32_t header_size;   // clusters
  uint64_t features;
  uint64_t compat_features;
  uint64_t autoclear_features;
  uint64_t l1_table_offset;  // bytes
  uint64_t image_size;       // bytes
  uint32_t backing_filename_offset;  // bytes from the start of the file
  uint32_t backing_filename_size;    // bytes
};
static_assert(sizeof(HeaderLayout) == 64);
static_assert(offsetof(HeaderLayout, features) == 16);
static_assert(offsetof(HeaderLayout, l1_table_offset) == 40);
static_assert(offsetof(HeaderLayout, backing_filename_offset) == 56);

inline constexpr size_t kHeaderBytes = sizeof(HeaderLayout);

}  // namespace qcowfs::image::qed
