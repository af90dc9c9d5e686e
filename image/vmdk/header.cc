#include <array>
#include <cstring>

#include "image/endian.h"
#include "image/vmdk/format.h"

namespace qcowfs::image::vmdk {

SparseHeader parse_sparse_header(std::span<const std::byte> in) {
  std::array<std::byte, kSector> b{};
  std::memcpy(b.data(), in.data(), std::min(in.size(), b.size()));
  SparseHeader h;
  const std::byte* p = b.data();
  if (load_be32(p) == kVmdk3MagicBe) {
    h.vmdk3 = true;
    h.version = load_le32(p + kV3Version);
    h.flags = load_le32(p + kV3Flags);
    h.capacity = load_le32(p + kV3DiskSectors);
    h.granularity = load_le32(p + kV3Granularity);
    h.gd_offset = load_le32(p + kV3L1Offset);
    h.gd_entries = load_le32(p + kV3L1Size);
    h.num_gtes_per_gt = kV3GtesPerGt;
    return h;
  }
  h.version = load_le32(p + kV4Version);
  h.flags = load_le32(p + kV4Flags);
  h.capacity = load_le64(p + kV4Capacity);
  h.granularity = load_le64(p + kV4Granularity);
  h.desc_offset = load_le64(p + kV4DescOffset);
  h.desc_size = load_le64(p + kV4DescSize);
  h.num_gtes_per_gt = load_le32(p + kV4NumGtes);
  h.rgd_offset = load_le64(p + kV4RgdOffset);
  h.gd_offset = load_le64(p + kV4GdOffset);
  h.grain_offset = load_le64(p + kV4GrainOffset);
  h.compress_algorithm = load_le16(p + kV4Compress);
  return h;
}

std::array<std::byte, kSector> serialize_sparse_header(const SparseHeader& h) {
  std::array<std::byte, kSector> b{};
  std::byte* p = b.data();
  store_be32(p, kVmdk4MagicBe);
  store_le32(p + kV4Version, h.version);
  store_le32(p + kV4Flags, h.flags);
  store_le64(p + kV4Capacity, h.capacity);
  store_le64(p + kV4Granularity, h.granularity);
  store_le64(p + kV4DescOffset, h.desc_offset);
  store_le64(p + kV4DescSize, h.desc_size);
  store_le32(p + kV4NumGtes, h.num_gtes_per_gt);
  store_le64(p + kV4RgdOffset, h.rgd_offset);
  store_le64(p + kV4GdOffset, h.gd_offset);
  store_le64(p + kV4GrainOffset, h.grain_offset);
  for (size_t i = 0; i < kV4CheckBytesValue.size(); ++i) p[kV4CheckBytes + i] = std::byte{kV4CheckBytesValue[i]};
  store_le16(p + kV4Compress, h.compress_algorithm);
  return b;
}

}  // namespace qcowfs::image::vmdk
