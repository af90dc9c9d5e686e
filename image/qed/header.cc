#include "image/qed/header.h"

#include "image/extent/host_read.h"

#include <bit>
#include <cstddef>
#include <limits>

#include "image/endian.h"

namespace qcowfs::image::qed {
namespace {

Header decode(std::span<const std::byte> b) {
  Header h;
  h.cluster_size = load_le32(b.data() + offsetof(HeaderLayout, cluster_size));
  h.table_size = load_le32(b.data() + offsetof(HeaderLayout, table_size));
  h.header_size = load_le32(b.data() + offsetof(HeaderLayout, header_size));
  h.features = load_le64(b.data() + offsetof(HeaderLayout, features));
  h.l1_table_offset = load_le64(b.data() + offsetof(HeaderLayout, l1_table_offset));
  h.image_size = load_le64(b.data() + offsetof(HeaderLayout, image_size));
  h.backing_filename_offset = load_le32(b.data() + offsetof(HeaderLayout, backing_filename_offset));
  h.backing_filename_size = load_le32(b.data() + offsetof(HeaderLayout, backing_filename_size));
  return h;
}

void derive_geometry(Header& h) {
  h.table_nelems = static_cast<uint32_t>(h.table_bytes() / sizeof(uint64_t));
  h.l2_shift = static_cast<uint32_t>(std::countr_zero(h.cluster_size));
  h.l2_mask = h.table_nelems - 1ull;
  h.l1_shift = h.l2_shift + static_cast<uint32_t>(std::countr_zero(h.table_nelems));
}

// The checks of bdrv_qed_do_open() that follow the magic, in QEMU's order.
Status check_geometry(const Header& h, const std::string& path) {
  if (h.features & ~kFeatureMask)
    return Status::errorf(ENOTSUP, "{}: Unsupported QED features: {:x}", path, h.features & ~kFeatureMask);
  if (!power_of_two_in(h.cluster_size, kMinClusterSize, kMaxClusterSize))
    return Status::errorf(EINVAL, "{}: QED cluster size is invalid (cluster_size {})", path, h.cluster_size);
  if (!power_of_two_in(h.table_size, kMinTableSize, kMaxTableSize))
    return Status::errorf(EINVAL, "{}: QED table size is invalid (table_size {})", path, h.table_size);
  if (h.image_size % kSectorSize != 0 || h.image_size > max_image_size(h.cluster_size, h.table_size) ||
      h.image_size > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
    return Status::errorf(EINVAL, "{}: QED image size is invalid (image_size {}, at most {} for this geometry)", path,
                          h.image_size, max_image_size(h.cluster_size, h.table_size));
  if (!h.valid_table_offset(h.l1_table_offset))
    return Status::errorf(EINVAL, "{}: QED table offset is invalid (l1_table_offset {:#x}, table_size {})", path,
                          h.l1_table_offset, h.table_size);
  if (h.header_size > std::numeric_limits<uint32_t>::max() / h.cluster_size)
    return Status::errorf(EINVAL, "{}: QED header size is too large (header_size {})", path, h.header_size);
  return Status::ok();
}

Status check_backing_name(const Header& h, const std::string& path) {
  if (!h.has_backing()) return Status::ok();
  if (uint64_t{h.backing_filename_offset} + h.backing_filename_size > uint64_t{h.cluster_size} * h.header_size)
    return Status::errorf(EINVAL, "{}: QED backing filename offset is invalid (offset {}, size {})", path,
                          h.backing_filename_offset, h.backing_filename_size);
  if (h.backing_filename_size >= kBackingNameBuffer)
    return Status::errorf(EINVAL, "{}: Failed to read backing filename (backing_filename_size {} is too long)", path,
                          h.backing_filename_size);
  return Status::ok();
}

}  // namespace

uint64_t max_image_size(uint32_t cluster_size, uint32_t table_size) {
  uint64_t entries = uint64_t{table_size} * cluster_size / sizeof(uint64_t);
  uint64_t l2_size = entries * cluster_size;
  return l2_size * entries;  // wraps as QEMU's does
}

bool Header::valid_cluster_offset(uint64_t host, uint64_t file_bytes) const {
  if (host & cluster_mask()) return false;
  return host >= uint64_t{header_size} * cluster_size && host < (file_bytes & ~cluster_mask());
}

bool Header::valid_table_offset(uint64_t host, uint64_t file_bytes) const {
  uint64_t end = host + (table_size - 1ull) * cluster_size;
  if (end <= host) return false;  // QEMU's overflow check, true for table_size 1
  return valid_cluster_offset(host, file_bytes) && valid_cluster_offset(end, file_bytes);
}

Result<Header> parse_header(std::span<const std::byte> bytes, uint64_t file_size, const std::string& path) {
  if (bytes.size() < kHeaderBytes) return Status::errorf(EINVAL, "{}: QED header is truncated", path);
  if (load_le32(bytes.data()) != kMagic) return Status::errorf(EINVAL, "{}: Image not in QED format", path);
  Header h = decode(bytes);
  // QEMU rounds the file size down to whole clusters before any offset check
  // (a nonsense cluster size is refused first by check_geometry).
  if (power_of_two_in(h.cluster_size, kMinClusterSize, kMaxClusterSize)) h.file_size = file_size & ~h.cluster_mask();
  QCOWFS_TRY(check_geometry(h, path));
  derive_geometry(h);
  QCOWFS_TRY(check_backing_name(h, path));
  return h;
}

Task<Result<Header>> read_header(io::HostFile& file, const std::string& path) {
  std::vector<std::byte> bytes(kHeaderBytes);
  QCOWFS_CO_TRY(co_await read_padded(file, 0, bytes));
  co_return parse_header(bytes, file.size(), path);
}

}  // namespace qcowfs::image::qed
