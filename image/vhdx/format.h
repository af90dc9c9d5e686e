// VHDX on-disk format constants and layouts ([MS-VHDX]; QEMU block/vhdx.h):
// signatures, GUIDs, fixed offsets, limits, BAT entry bits, and the byte
// offsets of every field qcowfs reads. Everything is little-endian on disk and
// read with image/endian.h at these offsets. This is the one header with VHDX
// constants. Thread-safety: constants only.
//
// Vocabulary, used by every file under image/vhdx/:
//   guest offset   a byte offset in the virtual disk
//   host offset    a byte offset in the .vhdx file
//   block          a payload block (block_size bytes of the virtual disk)
//   BAT index      an entry of the block allocation table: payload entries
//                  interleaved with one sector-bitmap entry every chunk_ratio
//                  payload entries
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace qcowfs::image::vhdx {

inline constexpr uint64_t kKiB = 1024;
inline constexpr uint64_t kMiB = 1024 * kKiB;
inline constexpr uint64_t kTiB = kMiB * kMiB;

// A GUID as its 16 bytes are stored on disk (data1..3 little-endian).
using Guid = std::array<uint8_t, 16>;

// ---- File identifier, headers, region tables (the first 1 MiB) ----
inline constexpr char kFileSignature[8] = {'v', 'h', 'd', 'x', 'f', 'i', 'l', 'e'};
inline constexpr size_t kCreatorOffset = 8;  // the file identifier's creator: UTF-16LE, informational
inline constexpr size_t kCreatorSize = 512;
inline constexpr uint64_t kHeaderOffsets[2] = {64 * kKiB, 128 * kKiB};
inline constexpr size_t kHeaderSize = 4 * kKiB;           // the checksum covers 4 KiB
inline constexpr uint32_t kHeaderSignature = 0x64616568;  // "head"
inline constexpr uint16_t kHeaderVersion = 1;
namespace header_field {
inline constexpr size_t kSignature = 0;
inline constexpr size_t kChecksum = 4;
inline constexpr size_t kSequenceNumber = 8;
inline constexpr size_t kFileWriteGuid = 16;
inline constexpr size_t kDataWriteGuid = 32;
inline constexpr size_t kLogGuid = 48;
inline constexpr size_t kLogVersion = 64;
inline constexpr size_t kVersion = 66;
inline constexpr size_t kLogLength = 68;
inline constexpr size_t kLogOffset = 72;
inline constexpr size_t kEnd = 80;  // sizeof(VHDXHeader): equal headers compare these bytes
}  // namespace header_field

// QEMU reads only the first region table (vhdx_open_region_tables).
inline constexpr uint64_t kRegionTableOffset = 192 * kKiB;
inline constexpr size_t kRegionTableSize = 64 * kKiB;     // the checksum covers 64 KiB
inline constexpr uint32_t kRegionSignature = 0x69676572;  // "regi"
inline constexpr uint32_t kMaxRegionEntries = 2047;
inline constexpr size_t kRegionHeaderSize = 16;  // signature, checksum, entry_count, reserved
inline constexpr size_t kRegionEntryCountAt = 8;
inline constexpr size_t kRegionEntrySize = 32;  // guid, file_offset u64, length u32, data_bits u32
inline constexpr uint32_t kRegionRequired = 0x1;

inline constexpr Guid kBatGuid = {0x66, 0x77, 0xc2, 0x2d, 0x23, 0xf6, 0x00, 0x42,
                                  0x9d, 0x64, 0x11, 0x5e, 0x9b, 0xfd, 0x4a, 0x08};
inline constexpr Guid kMetadataGuid = {0x06, 0xa2, 0x7c, 0x8b, 0x90, 0x47, 0x9a, 0x4b,
                                       0xb8, 0xfe, 0x57, 0x5f, 0x05, 0x0f, 0x88, 0x6e};

// ---- Metadata region ----
inline constexpr uint64_t kMetadataSignature = 0x617461646174656dull;  // "metadata"
inline constexpr size_t kMetadataTableSize = 64 * kKiB;  // QEMU reads this much, whatever the region length
inline constexpr size_t kMetadataHeaderSize = 32;
inline constexpr size_t kMetadataEntryCountAt = 10;
inline constexpr size_t kMetadataEntrySize = 32;  // guid, offset u32, length u32, data_bits u32, reserved
inline constexpr uint32_t kMetadataVirtualDisk = 0x2;
inline constexpr uint32_t kMetadataRequired = 0x4;

inline constexpr Guid kFileParametersGuid = {0x37, 0x67, 0xa1, 0xca, 0x36, 0xfa, 0x43, 0x4d,
                                             0xb3, 0xb6, 0x33, 0xf0, 0xaa, 0x44, 0xe7, 0x6b};
inline constexpr Guid kVirtualDiskSizeGuid = {0x24, 0x42, 0xa5, 0x2f, 0x1b, 0xcd, 0x76, 0x48,
                                              0xb2, 0x11, 0x5d, 0xbe, 0xd8, 0x3b, 0xf4, 0xb8};
inline constexpr Guid kPage83Guid = {0xab, 0x12, 0xca, 0xbe, 0xe6, 0xb2, 0x23, 0x45,
                                     0x93, 0xef, 0xc3, 0x09, 0xe0, 0x00, 0xc7, 0x46};
inline constexpr Guid kLogicalSectorSizeGuid = {0x1d, 0xbf, 0x41, 0x81, 0x6f, 0xa9, 0x09, 0x47,
                                                0xba, 0x47, 0xf2, 0x33, 0xa8, 0xfa, 0xab, 0x5f};
inline constexpr Guid kPhysicalSectorSizeGuid = {0xc7, 0x48, 0xa3, 0xcd, 0x5d, 0x44, 0x71, 0x44,
                                                 0x9c, 0xc9, 0xe9, 0x88, 0x52, 0x51, 0xc5, 0x56};
inline constexpr Guid kParentLocatorGuid = {0x2d, 0x5f, 0xd3, 0xa8, 0x0b, 0xb3, 0x4d, 0x45,
                                            0xab, 0xf7, 0xd3, 0xd8, 0x48, 0x34, 0xab, 0x0c};

// File parameters item: block_size u32, flags u32.
inline constexpr uint32_t kLeaveBlocksAllocated = 0x1;
inline constexpr uint32_t kHasParent = 0x2;
inline constexpr uint32_t kMinBlockSize = 1 * kMiB;
inline constexpr uint32_t kMaxBlockSize = 256 * kMiB;
// The only logical sector size QEMU 7.2 opens (4096 is refused, ENOTSUP).
inline constexpr uint32_t kLogicalSectorSize = 512;
// The specification's (and qemu-img create's) largest virtual disk.
inline constexpr uint64_t kMaxVirtualSize = 64 * kTiB;
inline constexpr uint64_t kMaxSectorsPerBlock = 1ull << 23;  // chunk ratio = this * sector / block

// ---- BAT ----
inline constexpr uint64_t kBatStateMask = 0x7;
inline constexpr uint64_t kBatOffsetMask = 0xFFFFFFFFFFF00000ull;  // file offset in MiB, bits 20-63
inline constexpr size_t kBatEntrySize = 8;
enum BlockState : uint64_t {
  kNotPresent = 0,
  kUndefined = 1,
  kZero = 2,
  kUnmapped = 3,
  kUnmappedV095 = 5,  // UNMAPPED in pre-1.0 drafts; QEMU reads it as zeros too
  kFullyPresent = 6,
  kPartiallyPresent = 7,  // differencing disks only
};
// The first MiB holds headers and region tables: no payload block lives there.
inline constexpr uint64_t kHeaderSectionSize = 1 * kMiB;

// ---- Log ----
inline constexpr uint64_t kLogAlign = 1 * kMiB;  // log offset and length
inline constexpr size_t kLogSectorSize = 4096;
inline constexpr uint32_t kLogEntrySignature = 0x65676f6c;  // "loge"
inline constexpr uint32_t kLogDescSignature = 0x63736564;   // "desc"
inline constexpr uint32_t kLogZeroSignature = 0x6f72657a;   // "zero"
namespace log_field {
inline constexpr size_t kSignature = 0;
inline constexpr size_t kChecksum = 4;
inline constexpr size_t kEntryLength = 8;
inline constexpr size_t kSequenceNumber = 16;
inline constexpr size_t kDescriptorCount = 24;
inline constexpr size_t kTail = 12;
inline constexpr size_t kLogGuid = 32;
inline constexpr size_t kFlushedFileOffset = 48;
inline constexpr size_t kLastFileOffset = 56;
inline constexpr size_t kHeaderSize = 64;
// Descriptors follow the entry header, 32 bytes each.
inline constexpr size_t kDescSize = 32;
inline constexpr size_t kDescZeroLength = 8;     // zero descriptor: length to zero
inline constexpr size_t kDescTrailingBytes = 4;  // data descriptor: the sector's last 4 bytes
inline constexpr size_t kDescLeadingBytes = 8;   // data descriptor: the sector's first 8 bytes
inline constexpr size_t kDescFileOffset = 16;
inline constexpr size_t kDescSequenceNumber = 24;
// A data sector: signature "data", sequence_high, 4084 bytes of the target
// sector (its bytes 8..4092), sequence_low.
inline constexpr size_t kDataSequenceHigh = 4;
inline constexpr size_t kDataBytes = 8;
inline constexpr size_t kDataBytesLength = 4084;
inline constexpr size_t kDataSequenceLow = 4092;
}  // namespace log_field
inline constexpr uint32_t kLogDataSignature = 0x61746164;  // "data"
// qcowfs reads at most this much log when a log GUID is set (each open scans
// it, as QEMU does); QEMU creates 1 MiB logs, as does Hyper-V.
inline constexpr uint64_t kMaxLogLength = 1024 * kMiB;
// A replayed log may grow the file (last_file_offset) by at most this much:
// QEMU and Hyper-V log metadata already inside the file.
inline constexpr uint64_t kMaxReplayGrowth = 1024 * kMiB;

}  // namespace qcowfs::image::vhdx
