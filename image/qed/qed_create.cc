#include "image/qed/qed_create.h"

#include <bit>
#include <cstddef>
#include <cstring>
#include <fmt/format.h>

#include "image/endian.h"
#include "image/qed/format.h"
#include "image/qed/header.h"
#include "io/align.h"
#include "io/buffer.h"

namespace qcowfs::image {
namespace {

using namespace qed;

inline constexpr uint32_t kDefaultClusterSize = 64 * 1024;
inline constexpr uint32_t kDefaultTableSize = 4;

struct QedCreate {
  std::string path;
  uint64_t size = 0;        // as given (the Formatting line)
  uint64_t image_size = 0;  // in whole sectors (the header)
  uint32_t cluster_size = kDefaultClusterSize;
  uint32_t table_size = kDefaultTableSize;
  bool table_size_given = false;
  std::string backing_file, backing_format;
};

// The first cluster: the header as bdrv_qed_co_create() fills it, and the
// backing file name right after it.
io::AlignedBuffer header_cluster(const QedCreate& c) {
  io::AlignedBuffer b(c.cluster_size);
  std::byte* p = b.data();
  uint64_t features = 0;
  if (!c.backing_file.empty()) {
    features |= kFeatureBackingFile;
    if (c.backing_format == "raw") features |= kFeatureBackingFormatNoProbe;
    store_le32(p + offsetof(HeaderLayout, backing_filename_offset), static_cast<uint32_t>(kHeaderBytes));
    store_le32(p + offsetof(HeaderLayout, backing_filename_size), static_cast<uint32_t>(c.backing_file.size()));
    std::memcpy(p + kHeaderBytes, c.backing_file.data(), c.backing_file.size());
  }
  store_le32(p + offsetof(HeaderLayout, magic), kMagic);
  store_le32(p + offsetof(HeaderLayout, cluster_size), c.cluster_size);
  store_le32(p + offsetof(HeaderLayout, table_size), c.table_size);
  store_le32(p + offsetof(HeaderLayout, header_size), 1);
  store_le64(p + offsetof(HeaderLayout, features), features);
  store_le64(p + offsetof(HeaderLayout, l1_table_offset), c.cluster_size);
  store_le64(p + offsetof(HeaderLayout, image_size), c.image_size);
  return b;
}

std::string formatting(const QedCreate& c) {
  std::string s = fmt::format("fmt=qed size={}", c.size);
  if (!c.backing_file.empty()) s += fmt::format(" backing_file={}", c.backing_file);
  if (!c.backing_format.empty()) s += fmt::format(" backing_fmt={}", c.backing_format);
  s += fmt::format(" cluster_size={}", c.cluster_size);
  if (c.table_size_given) s += fmt::format(" table_size={}", c.table_size);
  return s;
}

Result<uint32_t> take_u32(CreateRequest& r, std::string_view key, uint32_t def, bool* given = nullptr) {
  auto v = take_create_option(r.options, key);
  if (!v) return def;
  if (given) *given = true;
  auto n = parse_create_size(key, *v);
  if (!n) return n.status();
  return static_cast<uint32_t>(std::min<uint64_t>(*n, UINT32_MAX));
}

}  // namespace

Result<std::unique_ptr<Creator>> prepare_qed_create(const CreateRequest& request) {
  CreateRequest r = request;
  QedCreate c;
  c.path = r.path;
  c.backing_file = r.backing_file;
  c.backing_format = r.backing_format;
  auto cs = take_u32(r, "cluster_size", kDefaultClusterSize);
  if (!cs) return cs.status();
  auto ts = take_u32(r, "table_size", kDefaultTableSize, &c.table_size_given);
  if (!ts) return ts.status();
  QCOWFS_TRY(no_options_left(r.options, "qed"));
  auto size = required_size(r);
  if (!size) return size.status();
  c.size = *size;
  c.image_size = align_up(c.size, kSectorSize);
  c.cluster_size = *cs;
  c.table_size = *ts;
  if (!qed::power_of_two_in(c.cluster_size, kMinClusterSize, kMaxClusterSize))
    return Status::errorf(EINVAL, "{}: QED cluster size must be within range [{}, {}] and power of 2", r.path,
                          kMinClusterSize, kMaxClusterSize);
  if (!qed::power_of_two_in(c.table_size, kMinTableSize, kMaxTableSize))
    return Status::errorf(EINVAL, "{}: QED table size must be within range [{}, {}] and power of 2", r.path,
                          kMinTableSize, kMaxTableSize);
  // QEMU would write a longer name past its header cluster (or past what its
  // open reads) and make an image it cannot open.
  if (kHeaderBytes + c.backing_file.size() > c.cluster_size || c.backing_file.size() >= kBackingNameBuffer)
    return Status::errorf(ENAMETOOLONG, "{}: the backing file name ({} bytes) does not fit in QED's header cluster",
                          r.path, c.backing_file.size());
  const uint64_t max = max_image_size(c.cluster_size, c.table_size);
  if (c.image_size > max)
    return Status::errorf(EINVAL,
                          "{}: QED image size must be a non-zero multiple of cluster size and less than {} bytes",
                          r.path, max);
  // The header and backing file name, then the zeroed L1 table.
  const uint64_t length = uint64_t{c.cluster_size} * (1 + c.table_size);
  const size_t head_bytes = kHeaderBytes + c.backing_file.size();
  return new_image_file_creator(c.path, formatting(c), length, [c] { return header_cluster(c); }, head_bytes);
}

}  // namespace qcowfs::image
