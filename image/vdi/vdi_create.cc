#include "image/vdi/vdi_create.h"

#include <cstddef>
#include <cstring>
#include <fmt/format.h>
#include <random>

#include "image/endian.h"
#include "image/vdi/format.h"
#include "io/align.h"
#include "io/buffer.h"

namespace qcowfs::image {
namespace {

using namespace vdi;

inline constexpr std::string_view kText = "<<< QEMU VM Virtual Disk Image >>>\n";
inline constexpr uint32_t kHeaderSizeField = 0x180;  // QEMU's header_size: the fields after the version

struct VdiCreate {
  std::string path;
  uint64_t size = 0;       // as given (the Formatting line)
  uint64_t disk_size = 0;  // in whole sectors
  std::string static_text = "off";
  bool is_static = false;

  uint32_t blocks() const { return static_cast<uint32_t>((disk_size + kBlockSize - 1) / kBlockSize); }
  uint32_t bmap_bytes() const { return static_cast<uint32_t>(align_up(uint64_t{blocks()} * 4, kSectorSize)); }
  uint32_t offset_data() const { return kHeaderBytes + bmap_bytes(); }
};

// A random (version 4) UUID, as qemu_uuid_generate() makes.
void random_uuid(std::byte* out) {
  std::random_device rd;
  for (size_t i = 0; i < 16; i += 4) store_le32(out + i, rd());
  out[6] = (out[6] & std::byte{0x0f}) | std::byte{0x40};
  out[8] = (out[8] & std::byte{0x3f}) | std::byte{0x80};
}

// The header and block map, as vdi_co_do_create() writes them.
io::AlignedBuffer metadata(const VdiCreate& c) {
  io::AlignedBuffer b(c.offset_data());
  std::byte* p = b.data();
  std::memcpy(p, kText.data(), kText.size());
  store_le32(p + offsetof(HeaderLayout, signature), kSignature);
  store_le32(p + offsetof(HeaderLayout, version), kVersion1_1);
  store_le32(p + offsetof(HeaderLayout, header_size), kHeaderSizeField);
  store_le32(p + offsetof(HeaderLayout, image_type), c.is_static ? kTypeStatic : kTypeDynamic);
  store_le32(p + offsetof(HeaderLayout, offset_bmap), kHeaderBytes);
  store_le32(p + offsetof(HeaderLayout, offset_data), c.offset_data());
  store_le32(p + offsetof(HeaderLayout, sector_size), kSectorSize);
  store_le64(p + offsetof(HeaderLayout, disk_size), c.disk_size);
  store_le32(p + offsetof(HeaderLayout, block_size), kBlockSize);
  store_le32(p + offsetof(HeaderLayout, blocks_in_image), c.blocks());
  store_le32(p + offsetof(HeaderLayout, blocks_allocated), c.is_static ? c.blocks() : 0);
  random_uuid(p + offsetof(HeaderLayout, uuid_image));
  random_uuid(p + offsetof(HeaderLayout, uuid_last_snap));
  for (uint32_t i = 0; i < c.blocks(); ++i) store_le32(p + kHeaderBytes + i * 4, c.is_static ? i : kUnallocated);
  return b;
}

}  // namespace

Result<std::unique_ptr<Creator>> prepare_vdi_create(const CreateRequest& request) {
  CreateRequest r = request;
  VdiCreate c;
  c.path = r.path;
  if (auto v = take_create_option(r.options, "static")) {
    auto on = parse_create_bool("static", *v);
    if (!on) return on.status();
    c.is_static = *on;
    c.static_text = *v;
  }
  QCOWFS_TRY(no_options_left(r.options, "vdi"));
  QCOWFS_TRY(no_backing_file(r, "vdi"));
  auto size = required_size(r);
  if (!size) return size.status();
  c.size = *size;
  c.disk_size = align_up(c.size, kSectorSize);
  if (c.disk_size > kMaxDiskSize)
    return Status::errorf(EINVAL, "{}: Unsupported VDI image size (size is {:#x}, max supported is {:#x})", r.path,
                          c.disk_size, kMaxDiskSize);
  // A static image's file holds every block.
  const uint64_t length = c.offset_data() + (c.is_static ? uint64_t{c.blocks()} * kBlockSize : 0);
  std::string formatting = fmt::format("fmt=vdi size={} static={}", c.size, c.static_text);
  return new_image_file_creator(c.path, std::move(formatting), length, [c] { return metadata(c); });
}

}  // namespace qcowfs::image
