// VDI (VirtualBox Disk Image) on-disk constants and the header layout, as
// QEMU 7.2's block/vdi.c reads them. Every field is little-endian on disk and
// is read with image/endian.h at offsetof(...), never through the struct.
// Thread-safety: constants only.
//
// Vocabulary, used by every file under image/vdi/:
//   guest offset  a byte offset in the virtual disk (`guest`)
//   host offset   a byte offset in the image file (`host`)
//   block         a 1 MiB unit of the virtual disk; its block map entry is the
//                 index of the data block that holds it, or a marker below
#pragma once

#include <cstddef>
#include <cstdint>

namespace qcowfs::image::vdi {

inline constexpr uint32_t kSignature = 0xbeda107f;
inline constexpr uint32_t kVersion1_1 = 0x00010001;
inline constexpr uint32_t kTypeDynamic = 1;
inline constexpr uint32_t kTypeStatic = 2;
inline constexpr uint32_t kSectorSize = 512;
// The only block size QEMU accepts (block/vdi.c has no CONFIG_VDI_BLOCK_SIZE).
inline constexpr uint32_t kBlockSize = 1024 * 1024;
// qcowfs moves the data area of an image with no block allocated to this
// alignment (or the host's, if larger) before the first block: VirtualBox's
// (VDI_DATA_ALIGN, 1 MiB), so that every 1 MiB block is a whole aligned MiB
// of the host file.
inline constexpr uint32_t kDataAlign = 1 << 20;

// Block map entries.
inline constexpr uint32_t kUnallocated = 0xffffffff;  // never written: reads as zeros in QEMU
inline constexpr uint32_t kDiscarded = 0xfffffffe;    // zero-filled
inline constexpr bool is_allocated(uint32_t entry) { return entry < kDiscarded; }

// QEMU 7.2's VDI_BLOCKS_IN_IMAGE_MAX (QEMU_ALIGN_DOWN(INT_MAX, 512) / 4, so
// that the block map stays below 2 GiB) and VDI_DISK_SIZE_MAX.
inline constexpr uint32_t kMaxBlocksInImage = 0x1fffff80;
inline constexpr uint64_t kMaxDiskSize = uint64_t{kMaxBlocksInImage} * kBlockSize;
// Our limit on the block map read at open (4 bytes per block): 64 TiB disks.
inline constexpr uint64_t kMaxBlockMapBytes = 256ull << 20;

struct HeaderLayout {
  char text[0x40];
  uint32_t signature;
  uint32_t version;
  uint32_t header_size;
  uint32_t image_type;
  uint32_t image_flags;
  char description[256];
  uint32_t offset_bmap;  // bytes
  uint32_t offset_data;  // bytes
  uint32_t cylinders;
  uint32_t heads;
  uint32_t sectors;
  uint32_t sector_size;
  uint32_t unused1;
  uint64_t disk_size;  // bytes
  uint32_t block_size;
  uint32_t block_extra;  // ignored by QEMU, and so here
  uint32_t blocks_in_image;
  uint32_t blocks_allocated;
  uint8_t uuid_image[16];
  uint8_t uuid_last_snap[16];
  uint8_t uuid_link[16];
  uint8_t uuid_parent[16];
  uint64_t unused2[7];
} __attribute__((packed));
static_assert(sizeof(HeaderLayout) == 512);
static_assert(offsetof(HeaderLayout, signature) == 64);
static_assert(offsetof(HeaderLayout, offset_bmap) == 340);
static_assert(offsetof(HeaderLayout, disk_size) == 368);
static_assert(offsetof(HeaderLayout, blocks_in_image) == 384);
static_assert(offsetof(HeaderLayout, uuid_link) == 424);

inline constexpr size_t kHeaderBytes = sizeof(HeaderLayout);

}  // namespace qcowfs::image::vdi
