#include "image/vpc/header.h"

#include <bit>
#include <cstring>

#include "image/endian.h"

namespace qcowfs::image::vpc {
namespace {

// The creator applications whose images QEMU sizes by current_size
// (vpc_ignore_current_size() is false for them); compared over 4 bytes.
constexpr std::array<std::string_view, 5> kCurrentSizeCreators = {
    std::string_view("win ", 4), std::string_view("qem2", 4), std::string_view("d2v ", 4),
    std::string_view("CTXS", 4), std::string_view("tap\0", 4)};

bool sizes_by_current_size(const Footer& f) {
  const std::string_view app(f.creator_app.data(), f.creator_app.size());
  for (std::string_view c : kCurrentSizeCreators)
    if (app == c) return true;
  return false;
}

// ~(sum of the bytes), the 4-byte checksum field at `field` counted as zeros.
uint32_t checksum(std::span<const std::byte> b, size_t field) {
  uint32_t sum = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    if (i >= field && i < field + 4) continue;
    sum += static_cast<uint8_t>(b[i]);
  }
  return ~sum;
}

}  // namespace

bool has_cookie(std::span<const std::byte> b, std::string_view cookie) {
  return b.size() >= cookie.size() && std::memcmp(b.data(), cookie.data(), cookie.size()) == 0;
}

uint32_t footer_checksum(std::span<const std::byte, kFooterSize> b) { return checksum(b, kFooterChecksumOff); }

uint32_t dyn_header_checksum(std::span<const std::byte, kDynHeaderSize> b) { return checksum(b, kDynChecksumOff); }

Result<Footer> parse_footer(std::span<const std::byte, kFooterSize> b, const std::string& path) {
  if (!has_cookie(b, kFooterCookie)) return Status::errorf(EINVAL, "{}: invalid VPC image (no footer cookie)", path);
  const uint32_t stored = load_be32(&b[kFooterChecksumOff]);
  const uint32_t computed = footer_checksum(b);
  if (stored != computed)
    return Status::errorf(EINVAL, "{}: incorrect VHD footer checksum ({:#x}, computed {:#x})", path, stored,
                          computed);
  Footer f;
  f.type = load_be32(&b[kFooterTypeOff]);
  f.data_offset = load_be64(&b[kFooterDataOffsetOff]);
  f.current_size = load_be64(&b[kFooterCurrentSizeOff]);
  f.cyls = load_be16(&b[kFooterCylsOff]);
  f.heads = static_cast<uint8_t>(b[kFooterHeadsOff]);
  f.secs = static_cast<uint8_t>(b[kFooterSecsOff]);
  std::memcpy(f.creator_app.data(), &b[kFooterCreatorAppOff], f.creator_app.size());
  return f;
}

Result<uint64_t> virtual_sectors(const Footer& f, const std::string& path) {
  uint64_t sectors = uint64_t{f.cyls} * f.heads * f.secs;
  if (sizes_by_current_size(f) || sectors == kMaxGeometry) sectors = f.current_size / kSector;
  if (sectors > kMaxSectors)
    return Status::errorf(EFBIG, "{}: VHD disk size of {} sectors is past QEMU's limit of {} (2040 GiB)", path,
                          sectors, kMaxSectors);
  return sectors;
}

Result<DynHeader> parse_dyn_header(std::span<const std::byte, kDynHeaderSize> b, uint64_t sectors,
                                   const std::string& path) {
  if (!has_cookie(b, kDynCookie))
    return Status::errorf(EINVAL, "{}: invalid VHD dynamic disk header magic (no \"cxsparse\")", path);
  DynHeader h;
  h.table_offset = load_be64(&b[kDynTableOffsetOff]);
  h.max_table_entries = load_be32(&b[kDynMaxTableEntriesOff]);
  h.block_size = load_be32(&b[kDynBlockSizeOff]);
  if (!std::has_single_bit(h.block_size) || h.block_size < kSector)
    return Status::errorf(EINVAL, "{}: invalid VHD block size {}", path, h.block_size);
  if (sectors * kSector / h.block_size > 0xffffffffu) return Status::errorf(EINVAL, "{}: too many VHD blocks", path);
  if (uint64_t{h.max_table_entries} * h.block_size < sectors * kSector)
    return Status::errorf(EINVAL, "{}: VHD BAT too small: {} entries of {} bytes for a disk of {} bytes", path,
                          h.max_table_entries, h.block_size, sectors * kSector);
  if (h.max_table_entries > kQemuMaxTableEntries)
    return Status::errorf(EINVAL, "{}: VHD max_table_entries too large ({})", path, h.max_table_entries);
  if (h.max_table_entries > kMaxTableEntries)
    return Status::errorf(EINVAL, "{}: VHD max_table_entries {} is past qcowfs's limit of {} (a {} MiB BAT)", path,
                          h.max_table_entries, kMaxTableEntries, kMaxTableEntries * 4 >> 20);
  return h;
}

std::array<std::byte, kFooterSize> serialize_footer(const Footer& f) {
  std::array<std::byte, kFooterSize> b{};
  std::memcpy(&b[kFooterCookieOff], kFooterCookie.data(), kFooterCookie.size());
  store_be32(&b[kFooterFeaturesOff], kFooterFeatures);
  store_be32(&b[kFooterVersionOff], kFormatVersion);
  store_be64(&b[kFooterDataOffsetOff], f.data_offset);
  store_be32(&b[kFooterTimestampOff], f.timestamp);
  std::memcpy(&b[kFooterCreatorAppOff], f.creator_app.data(), f.creator_app.size());
  store_be32(&b[kFooterCreatorVerOff], f.creator_ver);
  std::memcpy(&b[kFooterCreatorOsOff], f.creator_os.data(), f.creator_os.size());
  store_be64(&b[kFooterOrigSizeOff], f.orig_size);
  store_be64(&b[kFooterCurrentSizeOff], f.current_size);
  store_be16(&b[kFooterCylsOff], f.cyls);
  b[kFooterHeadsOff] = std::byte{f.heads};
  b[kFooterSecsOff] = std::byte{f.secs};
  store_be32(&b[kFooterTypeOff], f.type);
  std::memcpy(&b[kFooterUuidOff], f.uuid.data(), f.uuid.size());
  store_be32(&b[kFooterChecksumOff], footer_checksum(b));
  return b;
}

std::array<std::byte, kDynHeaderSize> serialize_dyn_header(const DynHeader& h) {
  std::array<std::byte, kDynHeaderSize> b{};
  std::memcpy(&b[kDynCookieOff], kDynCookie.data(), kDynCookie.size());
  store_be64(&b[kDynDataOffsetOff], ~uint64_t{0});
  store_be64(&b[kDynTableOffsetOff], h.table_offset);
  store_be32(&b[kDynVersionOff], kFormatVersion);
  store_be32(&b[kDynMaxTableEntriesOff], h.max_table_entries);
  store_be32(&b[kDynBlockSizeOff], h.block_size);
  store_be32(&b[kDynChecksumOff], dyn_header_checksum(b));
  return b;
}

}  // namespace qcowfs::image::vpc
