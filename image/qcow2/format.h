// qcow2 on-disk format constants: magic numbers, limits, bit masks, feature
// bits, header extension types and the fixed struct layouts. This is the one
// header with format constants; the prose description is
// /work/shared/docs/qcow2-format.md (normative: QEMU docs/interop/qcow2.txt).
// The structs describe layouts only: every field is big-endian on disk and is
// read with image/endian.h at offsetof(...), never through the struct.
// Thread-safety: constants only.
//
// Vocabulary, used by every file under image/qcow2/:
//   guest offset   a byte offset in the virtual disk (GuestOffset; variables
//                  `guest`, ranges [guest, guest + len))
//   host offset    a byte offset in the image (or external data) file (HostOffset;
//                  variables `host`)
//   guest cluster  a cluster index in the virtual disk, guest offset >> cluster_bits
//                  (GuestCluster; variables `gc`, `first_gc`, `end_gc`)
//   host cluster   a cluster index in the image file, host offset >> cluster_bits
//                  (HostCluster; variables `hc`, `first_hc`, `end_hc`)
//   L2 entry       the 64-bit word (plus the subcluster bitmap with extended L2)
//                  that maps one guest cluster; classified by classify_l2_entry()
//                  (image/qcow2/l2.h) and nowhere else
#pragma once

#include <cstddef>
#include <cstdint>

namespace qcowfs::image::qcow2 {

using GuestOffset = uint64_t;
using HostOffset = uint64_t;
using GuestCluster = uint64_t;
using HostCluster = uint64_t;

// ---- Header ----
inline constexpr uint32_t kMagic = 0x514649fb;  // "QFI\xfb"
inline constexpr uint32_t kMinClusterBits = 9;   // 512 B
inline constexpr uint32_t kMaxClusterBits = 21;  // 2 MiB (QEMU's limit)
inline constexpr uint32_t kMaxRefcountOrder = 6; // 64-bit refcounts
inline constexpr uint32_t kV2RefcountOrder = 4;  // implied by version 2
inline constexpr uint32_t kMaxBackingNameLength = 1023;
inline constexpr uint32_t kMaxFormatNameLength = 15;  // QEMU's backing_format buffer is 16 bytes
inline constexpr uint32_t kMinExtendedL2ClusterBits = 14;  // 16 KiB: 32 subclusters of 512 B
// Virtual disk sizes are whole 512-byte sectors (QEMU's BDRV_SECTOR_SIZE).
inline constexpr uint64_t kSectorSize = 512;

struct HeaderLayout {
  uint32_t magic;
  uint32_t version;
  uint64_t backing_file_offset;
  uint32_t backing_file_size;
  uint32_t cluster_bits;
  uint64_t size;
  uint32_t crypt_method;
  uint32_t l1_size;
  uint64_t l1_table_offset;
  uint64_t refcount_table_offset;
  uint32_t refcount_table_clusters;
  uint32_t nb_snapshots;
  uint64_t snapshots_offset;
  // version 3 from here
  uint64_t incompatible_features;
  uint64_t compatible_features;
  uint64_t autoclear_features;
  uint32_t refcount_order;
  uint32_t header_length;
  // optional additional fields (present when header_length > their offset)
  uint8_t compression_type;
  uint8_t padding[7];
};
static_assert(offsetof(HeaderLayout, backing_file_offset) == 8);
static_assert(offsetof(HeaderLayout, size) == 24);
static_assert(offsetof(HeaderLayout, l1_table_offset) == 40);
static_assert(offsetof(HeaderLayout, snapshots_offset) == 64);
static_assert(offsetof(HeaderLayout, incompatible_features) == 72);
static_assert(offsetof(HeaderLayout, refcount_order) == 96);
static_assert(offsetof(HeaderLayout, header_length) == 100);
static_assert(offsetof(HeaderLayout, compression_type) == 104);
static_assert(sizeof(HeaderLayout) == 112);

inline constexpr uint32_t kV2HeaderLength = 72;
inline constexpr uint32_t kV3MinHeaderLength = 104;
// Header length QEMU writes for v3 (through the padded compression_type).
inline constexpr uint32_t kV3HeaderLength = sizeof(HeaderLayout);

// crypt_method values
inline constexpr uint32_t kCryptNone = 0;
inline constexpr uint32_t kCryptAes = 1;
inline constexpr uint32_t kCryptLuks = 2;

// compression_type values
inline constexpr uint8_t kCompressionZlib = 0;
inline constexpr uint8_t kCompressionZstd = 1;

// ---- Feature bits ----
inline constexpr uint64_t kIncompatDirty = 1ull << 0;
inline constexpr uint64_t kIncompatCorrupt = 1ull << 1;
inline constexpr uint64_t kIncompatDataFile = 1ull << 2;
inline constexpr uint64_t kIncompatCompression = 1ull << 3;
inline constexpr uint64_t kIncompatExtendedL2 = 1ull << 4;
inline constexpr uint64_t kIncompatKnown = kIncompatDirty | kIncompatCorrupt | kIncompatDataFile |
                                          kIncompatCompression | kIncompatExtendedL2;

inline constexpr uint64_t kCompatLazyRefcounts = 1ull << 0;

inline constexpr uint64_t kAutoclearBitmaps = 1ull << 0;
inline constexpr uint64_t kAutoclearDataFileRaw = 1ull << 1;

// Feature name table entry types (first byte of an entry).
enum class FeatureType : uint8_t { incompatible = 0, compatible = 1, autoclear = 2 };
inline constexpr size_t kFeatureNameEntrySize = 48;
inline constexpr size_t kFeatureNameLength = 46;
struct FeatureNameLayout {
  uint8_t type;  // FeatureType
  uint8_t bit;
  char name[kFeatureNameLength];  // NUL-padded
};
static_assert(offsetof(FeatureNameLayout, name) == 2);
static_assert(sizeof(FeatureNameLayout) == kFeatureNameEntrySize);

// ---- Header extensions ----
inline constexpr uint32_t kExtEnd = 0x00000000;
inline constexpr uint32_t kExtBackingFormat = 0xe2792aca;
inline constexpr uint32_t kExtFeatureTable = 0x6803f857;
inline constexpr uint32_t kExtBitmaps = 0x23852875;
inline constexpr uint32_t kExtCryptoHeader = 0x0537be77;
inline constexpr uint32_t kExtDataFile = 0x44415441;
inline constexpr size_t kExtHeaderSize = 8;  // u32 type, u32 length
inline constexpr size_t kExtAlign = 8;
struct ExtHeaderLayout {
  uint32_t type;
  uint32_t length;  // of the data that follows, before padding to kExtAlign
};
static_assert(offsetof(ExtHeaderLayout, length) == 4);
static_assert(sizeof(ExtHeaderLayout) == kExtHeaderSize);

struct BitmapsExtLayout {
  uint32_t nb_bitmaps;
  uint32_t reserved;
  uint64_t bitmap_directory_size;
  uint64_t bitmap_directory_offset;
};
static_assert(sizeof(BitmapsExtLayout) == 24);
inline constexpr uint32_t kMaxBitmaps = 65535;
inline constexpr uint64_t kMaxBitmapDirectorySize = 64ull << 20;

struct CryptoExtLayout {
  uint64_t offset;
  uint64_t length;
};
static_assert(sizeof(CryptoExtLayout) == 16);

// ---- Bitmap directory (bitmaps extension; entries 8-byte aligned) ----
struct BitmapDirEntryLayout {
  uint64_t bitmap_table_offset;
  uint32_t bitmap_table_size;
  uint32_t flags;
  uint8_t type;
  uint8_t granularity_bits;
  uint16_t name_size;
  uint32_t extra_data_size;
};
static_assert(offsetof(BitmapDirEntryLayout, flags) == 12);
static_assert(offsetof(BitmapDirEntryLayout, name_size) == 18);
static_assert(sizeof(BitmapDirEntryLayout) == 24);
inline constexpr uint32_t kBitmapFlagInUse = 1u << 0;
inline constexpr uint32_t kBitmapFlagAuto = 1u << 1;
inline constexpr uint64_t kBitmapTableOffsetMask = 0x00fffffffffffe00ull;  // bits 9-55
inline constexpr size_t kBitmapDirEntryAlign = 8;
inline constexpr size_t kBitmapTableEntrySize = 8;
inline constexpr uint8_t kBitmapTypeDirtyTracking = 1;
inline constexpr uint32_t kBitmapReservedFlags = 0xfffffffcu;
// Bitmap table entries: bits 9-55 the data cluster's offset; bit 0 "all ones"
// (only without an offset); bits 1-8 and 56-63 reserved.
inline constexpr uint64_t kBitmapTableReservedMask = 0xff000000000001feull;
inline constexpr uint64_t kBitmapTableAllOnes = 1ull << 0;
// QEMU's limits (block/qcow2-bitmap.c, BME_*): a directory entry outside them
// makes QEMU refuse the image.
inline constexpr uint32_t kBitmapMaxTableSize = 0x8000000;          // entries
inline constexpr uint64_t kBitmapMaxPhysBytes = 0x20000000;         // table_size * cluster_size
inline constexpr uint32_t kBitmapMinGranularityBits = 9;
inline constexpr uint32_t kBitmapMaxGranularityBits = 31;
inline constexpr uint32_t kBitmapMaxNameSize = 1023;

// ---- Table limits (QEMU's implementation limits; bound every allocation) ----
inline constexpr uint64_t kMaxL1Bytes = 32ull << 20;        // QCOW_MAX_L1_SIZE
inline constexpr uint64_t kMaxRefcountTableBytes = 8ull << 20;  // QCOW_MAX_REFTABLE_SIZE
inline constexpr uint32_t kMaxSnapshots = 65536;
inline constexpr uint64_t kMaxSnapshotTableBytes = 64ull << 20;
inline constexpr uint32_t kMaxSnapshotExtraData = 1024;

// ---- L1 / L2 entries ----
inline constexpr size_t kL1EntrySize = 8;
inline constexpr uint64_t kL1OffsetMask = 0x00fffffffffffe00ull;   // bits 9-55
inline constexpr uint64_t kL1ReservedMask = 0x7f000000000001ffull; // bits 0-8, 56-62
inline constexpr uint64_t kOflagCopied = 1ull << 63;
inline constexpr uint64_t kOflagCompressed = 1ull << 62;
inline constexpr uint64_t kOflagZero = 1ull << 0;
inline constexpr uint64_t kL2OffsetMask = 0x00fffffffffffe00ull;   // bits 9-55
// Standard descriptor reserved bits: 1-8 and 56-61 (bit 0 is the zero flag,
// itself reserved with extended L2 entries).
inline constexpr uint64_t kL2StandardReservedMask = 0x3f000000000001feull;
inline constexpr size_t kL2EntrySize = 8;
inline constexpr size_t kExtendedL2EntrySize = 16;
inline constexpr uint32_t kL2EntryBits = 3;          // log2(kL2EntrySize)
inline constexpr uint32_t kExtendedL2EntryBits = 4;  // log2(kExtendedL2EntrySize)
static_assert(kL2EntrySize == size_t{1} << kL2EntryBits && kExtendedL2EntrySize == size_t{1} << kExtendedL2EntryBits);
inline constexpr size_t kExtendedL2BitmapOffset = 8;  // the u64 subcluster bitmap after the entry
inline constexpr uint32_t kSubclustersPerCluster = 32;
inline constexpr uint64_t kSubclusterAllocMask = 0x00000000ffffffffull;  // bitmap bits 0-31
inline constexpr uint32_t kSubclusterZeroShift = 32;                      // bitmap bits 32-63

// Compressed descriptor: x = 62 - (cluster_bits - 8) bits of byte offset,
// then (cluster_bits - 8) bits of "additional 512-byte sectors".
inline constexpr uint64_t kCompressedSectorSize = 512;
constexpr uint32_t compressed_size_shift(uint32_t cluster_bits) { return 62 - (cluster_bits - 8); }
constexpr uint64_t compressed_offset_mask(uint32_t cluster_bits) {
  return (1ull << compressed_size_shift(cluster_bits)) - 1;
}
constexpr uint64_t compressed_sectors_mask(uint32_t cluster_bits) {
  return (1ull << (cluster_bits - 8)) - 1;
}
// Compressed zlib clusters are raw deflate streams with a 4 KiB window (QEMU
// passes -12 as inflateInit2's windowBits).
inline constexpr int kZlibWindowBits = 12;
// Offsets must lie below 2^56 whatever the cluster size.
inline constexpr uint64_t kMaxHostOffset = 1ull << 56;

// Reftable entries: bits 9-63 offset, 0-8 reserved.
inline constexpr size_t kReftableEntrySize = 8;
inline constexpr uint64_t kReftableOffsetMask = 0xfffffffffffffe00ull;

// ---- Snapshot table ----
struct SnapshotHeaderLayout {
  uint64_t l1_table_offset;
  uint32_t l1_size;
  uint16_t id_str_size;
  uint16_t name_size;
  uint32_t date_sec;
  uint32_t date_nsec;
  uint64_t vm_clock_nsec;
  uint32_t vm_state_size;
  uint32_t extra_data_size;
};
static_assert(offsetof(SnapshotHeaderLayout, id_str_size) == 12);
static_assert(offsetof(SnapshotHeaderLayout, vm_clock_nsec) == 24);
static_assert(offsetof(SnapshotHeaderLayout, extra_data_size) == 36);
static_assert(sizeof(SnapshotHeaderLayout) == 40);

struct SnapshotExtraLayout {
  uint64_t vm_state_size_large;
  uint64_t disk_size;
  uint64_t icount;
};
static_assert(offsetof(SnapshotExtraLayout, disk_size) == 8);
static_assert(sizeof(SnapshotExtraLayout) == 24);
inline constexpr size_t kSnapshotEntryAlign = 8;

}  // namespace qcowfs::image::qcow2
