#include "image/parallels/parallels_create.h"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fmt/format.h>
#include <limits>

#include "image/endian.h"
#include "image/parallels/format.h"
#include "io/align.h"
#include "io/buffer.h"

namespace qcowfs::image {
namespace {

using namespace parallels;

inline constexpr uint64_t kDefaultClusterSize = 1024 * 1024;
inline constexpr uint64_t kMaxImageFactor = 1ull << 32;  // QEMU's MAX_PARALLELS_IMAGE_FACTOR
inline constexpr uint32_t kHeads = 16;                   // QEMU's HEADS_NUMBER
inline constexpr uint32_t kSectorsInCylinder = 32;       // QEMU's SEC_IN_CYL

struct ParallelsCreate {
  std::string path;
  uint64_t size_given = 0;    // as given (the Formatting line)
  uint64_t cluster_given = 0;
  uint64_t size = 0;          // in whole sectors
  uint64_t cluster_size = 0;  // in whole sectors

  uint64_t bat_entries() const { return (size + cluster_size - 1) / cluster_size; }
  // The header and BAT in whole clusters, in sectors (QEMU's bat_sectors).
  uint64_t bat_sectors() const {
    return align_up(kBatOff + bat_entries() * 4, cluster_size) / kSector;
  }
};

// The first sector: the header as parallels_co_create() fills it (the BAT
// that follows is all zeros).
io::AlignedBuffer header_sector(const ParallelsCreate& c) {
  io::AlignedBuffer b(kSector);
  std::byte* p = b.data();
  std::memcpy(p + kMagicOff, kMagicExt.data(), kMagicExt.size());
  store_le32(p + kVersionOff, kVersion);
  store_le32(p + kHeadsOff, kHeads);
  store_le32(p + kCylindersOff, static_cast<uint32_t>(c.size / kSector / kHeads / kSectorsInCylinder));
  store_le32(p + kTracksOff, static_cast<uint32_t>(c.cluster_size / kSector));
  store_le32(p + kBatEntriesOff, static_cast<uint32_t>(c.bat_entries()));
  store_le64(p + kNbSectorsOff, c.size / kSector);
  store_le32(p + kDataOffOff, static_cast<uint32_t>(c.bat_sectors()));
  return b;
}

}  // namespace

Result<std::unique_ptr<Creator>> prepare_parallels_create(const CreateRequest& request) {
  CreateRequest r = request;
  ParallelsCreate c;
  c.path = r.path;
  c.cluster_given = kDefaultClusterSize;
  if (auto v = take_create_option(r.options, "cluster_size")) {
    auto n = parse_create_size("cluster_size", *v);
    if (!n) return n.status();
    c.cluster_given = *n;
  }
  QCOWFS_TRY(no_options_left(r.options, "parallels"));
  QCOWFS_TRY(no_backing_file(r, "parallels"));
  auto size = required_size(r);
  if (!size) return size.status();
  c.size_given = *size;
  if (c.cluster_given > std::numeric_limits<uint64_t>::max() - kSector ||
      c.size_given > std::numeric_limits<uint64_t>::max() - kSector)
    return Status::errorf(EINVAL, "{}: Image size is too large for this cluster size", r.path);
  c.size = align_up(c.size_given, kSector);
  c.cluster_size = align_up(c.cluster_given, kSector);
  if (c.cluster_size >= uint64_t{std::numeric_limits<int64_t>::max()} / kMaxImageFactor)
    return Status::errorf(EINVAL, "{}: Cluster size is too large", r.path);
  if (c.size >= kMaxImageFactor * c.cluster_size)
    return Status::errorf(E2BIG, "{}: Image size is too large for this cluster size", r.path);
  const uint64_t length = c.bat_sectors() * kSector;
  std::string formatting = fmt::format("fmt=parallels size={} cluster_size={}", c.size_given, c.cluster_given);
  return new_image_file_creator(c.path, std::move(formatting), length, [c] { return header_sector(c); });
}

}  // namespace qcowfs::image
