#include "image/vdi/header.h"

#include "image/extent/host_read.h"

#include <algorithm>
#include <cstddef>

#include "image/endian.h"

namespace qcowfs::image::vdi {
namespace {

uint32_t le32_at(std::span<const std::byte> b, size_t off) { return load_le32(b.data() + off); }

bool is_null_uuid(std::span<const std::byte> b, size_t off) {
  return std::all_of(b.begin() + static_cast<std::ptrdiff_t>(off), b.begin() + static_cast<std::ptrdiff_t>(off + 16),
                     [](std::byte x) { return x == std::byte{0}; });
}

// vdi_open()'s checks after the size check, in QEMU's order.
Status check_fields(std::span<const std::byte> b, const Header& h, const std::string& path) {
  const uint32_t signature = le32_at(b, offsetof(HeaderLayout, signature));
  const uint32_t version = le32_at(b, offsetof(HeaderLayout, version));
  const uint32_t sector_size = le32_at(b, offsetof(HeaderLayout, sector_size));
  const uint64_t room = uint64_t{h.blocks_in_image} * h.block_size;
  if (signature != kSignature)
    return Status::errorf(EINVAL, "{}: Image not in VDI format (bad signature {:08x})", path, signature);
  if (version != kVersion1_1)
    return Status::errorf(ENOTSUP, "{}: unsupported VDI image (version {}.{})", path, version >> 16, version & 0xffff);
  if (h.offset_bmap % kSectorSize != 0)
    return Status::errorf(ENOTSUP, "{}: unsupported VDI image (unaligned block map offset {:#x})", path,
                          h.offset_bmap);
  if (h.offset_data % kSectorSize != 0)
    return Status::errorf(ENOTSUP, "{}: unsupported VDI image (unaligned data offset {:#x})", path, h.offset_data);
  if (sector_size != kSectorSize)
    return Status::errorf(ENOTSUP, "{}: unsupported VDI image (sector size {} is not {})", path, sector_size,
                          kSectorSize);
  if (h.block_size != kBlockSize)
    return Status::errorf(ENOTSUP, "{}: unsupported VDI image (block size {} is not {})", path, h.block_size,
                          kBlockSize);
  if (h.disk_size > room)
    return Status::errorf(ENOTSUP, "{}: unsupported VDI image (disk size {}, image bitmap has room for {})", path,
                          h.disk_size, room);
  if (!is_null_uuid(b, offsetof(HeaderLayout, uuid_link)))
    return Status::errorf(ENOTSUP, "{}: unsupported VDI image (non-NULL link UUID)", path);
  if (!is_null_uuid(b, offsetof(HeaderLayout, uuid_parent)))
    return Status::errorf(ENOTSUP, "{}: unsupported VDI image (non-NULL parent UUID)", path);
  if (h.blocks_in_image > kMaxBlocksInImage)
    return Status::errorf(ENOTSUP, "{}: unsupported VDI image (too many blocks {}, max is {})", path,
                          h.blocks_in_image, kMaxBlocksInImage);
  return Status::ok();
}

}  // namespace

Result<Header> parse_header(std::span<const std::byte> b, const std::string& path) {
  if (b.size() < kHeaderBytes) return Status::errorf(EINVAL, "{}: VDI header is truncated", path);
  Header h;
  h.image_type = le32_at(b, offsetof(HeaderLayout, image_type));
  h.offset_bmap = le32_at(b, offsetof(HeaderLayout, offset_bmap));
  h.offset_data = le32_at(b, offsetof(HeaderLayout, offset_data));
  h.disk_size = load_le64(b.data() + offsetof(HeaderLayout, disk_size));
  h.block_size = le32_at(b, offsetof(HeaderLayout, block_size));
  h.blocks_in_image = le32_at(b, offsetof(HeaderLayout, blocks_in_image));
  h.blocks_allocated = le32_at(b, offsetof(HeaderLayout, blocks_allocated));
  if (h.disk_size > kMaxDiskSize)
    return Status::errorf(ENOTSUP, "{}: Unsupported VDI image size (size is {:#x}, max supported is {:#x})", path,
                          h.disk_size, kMaxDiskSize);
  // 'VBoxManage convertfromraw' writes odd sizes; QEMU rounds them up to a sector.
  h.disk_size = (h.disk_size + kSectorSize - 1) / kSectorSize * kSectorSize;
  QCOWFS_TRY(check_fields(b, h, path));
  return h;
}

Task<Result<Header>> read_header(io::HostFile& file, const std::string& path) {
  std::vector<std::byte> bytes(kHeaderBytes);
  QCOWFS_CO_TRY(co_await read_padded(file, 0, bytes));
  co_return parse_header(bytes, path);
}

}  // namespace qcowfs::image::vdi
