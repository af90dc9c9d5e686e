#include "image/vhdx/vhdx_create.h"

#include <bit>
#include <cstddef>
#include <cstring>
#include <fmt/format.h>
#include <limits>
#include <random>

#include "image/endian.h"
#include "image/vhdx/crc32c.h"
#include "image/vhdx/format.h"
#include "image/vhdx/header.h"
#include "image/vhdx/log_writer.h"
#include "io/align.h"
#include "io/buffer.h"

namespace qcowfs::image {
namespace {

using namespace vhdx;

inline constexpr uint64_t kDefaultLogSize = kMiB;
inline constexpr uint64_t kDataGap = 5 * kMiB;        // QEMU's data start: BAT end + 5 MiB
inline constexpr uint64_t kMetadataLength = kMiB;
inline constexpr size_t kItemsAt = 64 * kKiB;          // the metadata items, in the region
inline constexpr std::string_view kCreator = "qcowfs";

struct VhdxCreate {
  std::string path;
  uint64_t size_given = 0, log_given = kDefaultLogSize, block_given = 0;  // as given (the Formatting line)
  std::string subformat, zero_text;                                       // as given, "" if not
  uint64_t size = 0;  // whole sectors
  uint32_t log_size = 0;
  uint32_t block_size = 0;
  bool fixed = false;
  bool zero_blocks = true;
  Geometry g;

  uint64_t bat_offset() const { return align_up(kHeaderSectionSize + log_size, kMiB); }
  uint64_t bat_length() const { return align_up(uint64_t{g.bat_entries} * kBatEntrySize, kMiB); }
  uint64_t metadata_offset() const { return align_up(bat_offset() + bat_length(), kMiB); }
  uint64_t data_offset() const { return bat_offset() + bat_length() + kDataGap; }
};

void put_guid(std::byte* p, const Guid& g) { std::memcpy(p, g.data(), g.size()); }

// The first 64 KiB: the file identifier.
io::AlignedBuffer file_identifier() {
  io::AlignedBuffer b(64 * kKiB);
  std::memcpy(b.data(), kFileSignature, sizeof kFileSignature);
  for (size_t i = 0; i < kCreator.size(); ++i)
    store_le16(b.data() + kCreatorOffset + 2 * i, static_cast<uint16_t>(kCreator[i]));
  return b;
}

// vhdx_create_new_headers(): both 4 KiB headers (the second's sequence number one higher).
io::AlignedBuffer headers(const VhdxCreate& c) {
  namespace f = header_field;
  io::AlignedBuffer b(2 * kHeaderSize);
  const uint64_t seq = std::random_device{}();
  const Guid file_write = random_guid(), data_write = random_guid();
  for (size_t i = 0; i < 2; ++i) {
    std::byte* h = b.data() + i * kHeaderSize;
    store_le32(h + f::kSignature, kHeaderSignature);
    store_le64(h + f::kSequenceNumber, seq + i);
    put_guid(h + f::kFileWriteGuid, file_write);
    put_guid(h + f::kDataWriteGuid, data_write);
    store_le16(h + f::kVersion, kHeaderVersion);
    store_le32(h + f::kLogLength, c.log_size);
    store_le64(h + f::kLogOffset, kHeaderSectionSize);
    store_le32(h + f::kChecksum, crc32c_with_zeroed_field({h, kHeaderSize}, f::kChecksum));
  }
  return b;
}

void region_entry(std::byte* e, const Guid& guid, uint64_t offset, uint64_t length) {
  put_guid(e, guid);
  store_le64(e + 16, offset);
  store_le32(e + 24, static_cast<uint32_t>(length));
}

// vhdx_create_new_region_table(): the BAT and metadata regions.
io::AlignedBuffer region_table(const VhdxCreate& c) {
  io::AlignedBuffer b(kRegionTableSize);
  store_le32(b.data(), kRegionSignature);
  store_le32(b.data() + kRegionEntryCountAt, 2);
  region_entry(b.data() + kRegionHeaderSize, kBatGuid, c.bat_offset(), c.bat_length());
  region_entry(b.data() + kRegionHeaderSize + kRegionEntrySize, kMetadataGuid, c.metadata_offset(), kMetadataLength);
  store_le32(b.data() + 4, crc32c_with_zeroed_field(b.span(), 4));
  return b;
}

// vhdx_create_bat(): with zero blocks every block is ZERO; a fixed image's
// blocks are otherwise FULLY_PRESENT in guest order from the data offset.
io::AlignedBuffer bat(const VhdxCreate& c) {
  io::AlignedBuffer b(c.bat_length());
  const uint64_t state = c.zero_blocks ? kZero : c.fixed ? kFullyPresent : kNotPresent;
  for (uint64_t guest = 0; guest / kLogicalSectorSize < c.size / kLogicalSectorSize; guest += c.block_size) {
    const uint64_t host = state == kFullyPresent ? align_up(c.data_offset() + guest, kMiB) : 0;
    store_le64(b.data() + c.g.bat_index(guest) * kBatEntrySize, host | state);
  }
  return b;
}

// vhdx_create_new_metadata(): the table, then the five items at 64 KiB.
io::AlignedBuffer metadata(const VhdxCreate& c) {
  io::AlignedBuffer b(kItemsAt + kLogicalSectorSize);
  std::byte* p = b.data();
  store_le64(p, kMetadataSignature);
  store_le16(p + kMetadataEntryCountAt, 5);
  struct Item {
    const Guid& guid;
    uint32_t length;
    uint32_t flags;
  };
  const Item items[] = {{kFileParametersGuid, 8, kMetadataRequired},
                        {kVirtualDiskSizeGuid, 8, kMetadataRequired | kMetadataVirtualDisk},
                        {kPage83Guid, 16, kMetadataRequired | kMetadataVirtualDisk},
                        {kLogicalSectorSizeGuid, 4, kMetadataRequired | kMetadataVirtualDisk},
                        {kPhysicalSectorSizeGuid, 4, kMetadataRequired | kMetadataVirtualDisk}};
  uint32_t at = kItemsAt;
  for (size_t i = 0; i < std::size(items); ++i) {
    std::byte* e = p + kMetadataHeaderSize + i * kMetadataEntrySize;
    put_guid(e, items[i].guid);
    store_le32(e + 16, at);
    store_le32(e + 20, items[i].length);
    store_le32(e + 24, items[i].flags);
    at += items[i].length;
  }
  std::byte* v = p + kItemsAt;
  store_le32(v, c.block_size);
  store_le32(v + 4, c.fixed ? kLeaveBlocksAllocated : 0);
  store_le64(v + 8, c.size);
  put_guid(v + 16, random_guid());
  store_le32(v + 32, kLogicalSectorSize);
  store_le32(v + 36, kLogicalSectorSize);
  return b;
}

class VhdxCreator final : public Creator {
 public:
  explicit VhdxCreator(VhdxCreate c) : c_(std::move(c)) {}

  std::string formatting() const override {
    std::string s = fmt::format("fmt=vhdx size={} log_size={} block_size={}", c_.size_given, c_.log_given,
                                c_.block_given);
    if (!c_.subformat.empty()) s += fmt::format(" subformat={}", c_.subformat);
    if (!c_.zero_text.empty()) s += fmt::format(" block_state_zero={}", c_.zero_text);
    return s;
  }

  // In QEMU's order: identifier, headers, the file's length, BAT, region tables, metadata.
  Task<Status> write(NewFiles& files) override {
    auto f = files.create(c_.path);
    if (!f) co_return f.status();
    io::HostFile& file = **f;
    QCOWFS_CO_TRY(co_await file.write(0, file_identifier().span()));
    io::AlignedBuffer h = headers(c_);
    QCOWFS_CO_TRY(co_await file.write(kHeaderOffsets[0], h.span().first(kHeaderSize)));
    QCOWFS_CO_TRY(co_await file.write(kHeaderOffsets[1], h.span().subspan(kHeaderSize)));
    QCOWFS_CO_TRY(co_await file.truncate(c_.data_offset() + (c_.fixed ? c_.size : 0)));
    if (c_.fixed || c_.zero_blocks) QCOWFS_CO_TRY(co_await file.write(c_.bat_offset(), bat(c_).span()));
    io::AlignedBuffer rt = region_table(c_);
    QCOWFS_CO_TRY(co_await file.write(kRegionTableOffset, rt.span()));
    QCOWFS_CO_TRY(co_await file.write(kRegionTableOffset + kRegionTableSize, rt.span()));
    QCOWFS_CO_TRY(co_await file.write(c_.metadata_offset(), metadata(c_).span()));
    co_return co_await file.flush();
  }

 private:
  VhdxCreate c_;
};

Result<uint64_t> take_size(CreateRequest& r, std::string_view key, uint64_t def) {
  auto v = take_create_option(r.options, key);
  if (!v) return def;
  return parse_create_size(key, *v);
}

// QEMU's block size for a size when none is given.
uint32_t auto_block_size(uint64_t size) {
  constexpr uint64_t kGiB = 1024 * kMiB;
  if (size > 32 * kTiB) return 64 * kMiB;
  if (size > 100 * kGiB) return 32 * kMiB;
  if (size > kGiB) return 16 * kMiB;
  return 8 * kMiB;
}

Status check_sizes(VhdxCreate& c) {
  if (c.size > kMaxVirtualSize) return Status::errorf(EINVAL, "{}: Image size too large; max of 64TB", c.path);
  const uint64_t log = align_up(c.log_given, kMiB);
  if (log > std::numeric_limits<uint32_t>::max())
    return Status::errorf(EINVAL, "{}: Log size must be smaller than 4 GB", c.path);
  if (log < kMiB) return Status::errorf(EINVAL, "{}: Log size must be a multiple of 1 MB", c.path);
  c.log_size = static_cast<uint32_t>(log);
  const uint64_t block = std::min<uint64_t>(align_up(c.block_given, kMiB), kMaxBlockSize);
  c.block_size = block == 0 ? auto_block_size(c.size) : static_cast<uint32_t>(block);
  if (!std::has_single_bit(c.block_size))
    return Status::errorf(EINVAL, "{}: Block size must be a power of two", c.path);
  return Status::ok();
}

}  // namespace

Result<std::unique_ptr<Creator>> prepare_vhdx_create(const CreateRequest& request) {
  CreateRequest r = request;
  VhdxCreate c;
  c.path = r.path;
  auto log = take_size(r, "log_size", kDefaultLogSize);
  if (!log) return log.status();
  auto block = take_size(r, "block_size", 0);
  if (!block) return block.status();
  c.log_given = *log;
  c.block_given = *block;
  if (auto v = take_create_option(r.options, "subformat")) {
    if (*v != "dynamic" && *v != "fixed")
      return Status::errorf(EINVAL, "{}: Parameter 'subformat' does not accept value '{}'", r.path, *v);
    c.subformat = *v;
    c.fixed = *v == "fixed";
  }
  if (auto v = take_create_option(r.options, "block_state_zero")) {
    auto on = parse_create_bool("block_state_zero", *v);
    if (!on) return on.status();
    c.zero_blocks = *on;
    c.zero_text = *v;
  }
  QCOWFS_TRY(no_options_left(r.options, "vhdx"));
  QCOWFS_TRY(no_backing_file(r, "vhdx"));
  auto size = required_size(r);
  if (!size) return size.status();
  c.size_given = *size;
  if (c.size_given > kMaxVirtualSize) return Status::errorf(EINVAL, "{}: Image size too large; max of 64TB", r.path);
  c.size = align_up(c.size_given, kLogicalSectorSize);
  QCOWFS_TRY(check_sizes(c));
  Parameters p{.block_size = c.block_size,
               .virtual_disk_size = c.size,
               .logical_sector_size = kLogicalSectorSize,
               .physical_sector_size = kLogicalSectorSize};
  auto g = make_geometry(p, std::numeric_limits<uint32_t>::max(), r.path);
  if (!g) return g.status();
  c.g = *g;
  return std::unique_ptr<Creator>(new VhdxCreator(std::move(c)));
}

}  // namespace qcowfs::image
