// qemu-img create -f vpc (QEMU 7.2 block/vpc.c): the size rounded up to the
// first CHS geometry that holds it (calculate_rounded_image_size,
// calculate_geometry) unless force_size=on, then a fixed disk (the data, then
// the footer) or a dynamic one (create_dynamic_disk: footer copy, dynamic-disk
// header, an empty BAT, footer; blocks of 2 MiB).
#include "image/vpc/vpc_create.h"

#include <ctime>
#include <optional>
#include <random>
#include <vector>

#include "image/vpc/format.h"
#include "image/vpc/header.h"

namespace qcowfs::image {
namespace {

using namespace vpc;

constexpr uint32_t kNewBlockSize = 0x200000;  // qemu-img's 2 MiB blocks
constexpr uint32_t kCreatorVersion = 0x00050003;  // QEMU writes Virtual PC 2007's version
constexpr uint64_t kNewTableOffset = 3 * kSector;
// The geometry force_size=on writes, which says "size by current_size".
constexpr uint16_t kChsMaxCyls = 65535;
constexpr uint8_t kChsMaxHeads = 16, kChsMaxSecs = 255;

struct Geometry {
  uint16_t cyls = 0;
  uint8_t heads = 0;
  uint8_t secs = 0;
  uint64_t sectors() const { return uint64_t{cyls} * heads * secs; }
};

// calculate_geometry(): the VHD specification's CHS for a number of sectors
// (it may round down).
Geometry chs_of(uint64_t total_sectors) {
  total_sectors = std::min(total_sectors, kMaxGeometry);
  Geometry g;
  uint32_t cyls_times_heads = 0;
  if (total_sectors >= 65535ull * 16 * 63) {
    g.secs = 255;
    g.heads = 16;
    cyls_times_heads = static_cast<uint32_t>(total_sectors / g.secs);
  } else {
    g.secs = 17;
    cyls_times_heads = static_cast<uint32_t>(total_sectors / g.secs);
    g.heads = static_cast<uint8_t>(std::max<uint32_t>((cyls_times_heads + 1023) / 1024, 4));
    if (cyls_times_heads >= g.heads * 1024u || g.heads > 16) {
      g.secs = 31;
      g.heads = 16;
      cyls_times_heads = static_cast<uint32_t>(total_sectors / g.secs);
    }
    if (cyls_times_heads >= g.heads * 1024u) {
      g.secs = 63;
      g.heads = 16;
      cyls_times_heads = static_cast<uint32_t>(total_sectors / g.secs);
    }
  }
  g.cyls = static_cast<uint16_t>(cyls_times_heads / g.heads);
  return g;
}

struct Rounded {
  Geometry geometry;
  uint64_t sectors = 0;  // the disk's size
};

// calculate_rounded_image_size(): the first geometry at or above the size (a
// size past the largest geometry keeps the footer's current_size, as does
// force_size=on).
Result<Rounded> rounded_size(uint64_t bytes, bool force_size) {
  Rounded r;
  if (force_size) {
    r.geometry = Geometry{kChsMaxCyls, kChsMaxHeads, kChsMaxSecs};
  } else {
    const uint64_t wanted = std::min(kMaxGeometry, bytes / kSector);
    for (uint64_t i = 0; wanted > r.geometry.sectors(); ++i) r.geometry = chs_of(wanted + i);
  }
  if (r.geometry.sectors() == kMaxGeometry) {
    r.sectors = bytes / kSector;
    if (r.sectors > kMaxSectors) return Status::error(EFBIG, "Disk size is too large, max size is 2040 GiB");
  } else {
    r.sectors = r.geometry.sectors();
  }
  return r;
}

// The protocol layer's preallocation= (file-posix): accepted, and without
// effect on a VHD (its file is created empty).
Status check_preallocation(std::string_view v) {
  if (v == "off" || v == "falloc" || v == "full") return Status::ok();
  if (v == "metadata") return Status::error(EINVAL, "Unsupported preallocation mode: metadata");
  return Status::errorf(EINVAL, "invalid parameter value: {}", v);
}

struct Options {
  std::string path;
  uint64_t size = 0;  // the disk's bytes
  Geometry geometry;
  bool fixed = false;
  bool force_size = false;
  std::string formatting;
};

Result<Options> resolve_size(Options o, uint64_t requested) {
  if (requested > kMaxSectors * kSector) return Status::error(EFBIG, "The image size is too large for file format 'vpc'");
  o.size = (requested + kSector - 1) / kSector * kSector;
  // vpc_co_create_opts() rounds, then vpc_co_create() rounds the result again
  // and wants no change.
  for (int pass = 0; pass < 2; ++pass) {
    auto r = rounded_size(o.size, o.force_size);
    if (!r) return r.status();
    if (pass == 1 && r->sectors * kSector != o.size)
      return Status::errorf(EINVAL, "The requested image size cannot be represented in CHS geometry (try size={} or "
                                    "force_size=on, which makes the image incompatible with Virtual PC)",
                            r->sectors * kSector);
    if (!o.force_size) o.size = r->sectors * kSector;
    o.geometry = r->geometry;
  }
  return o;
}

Result<Options> parse_options(const CreateRequest& r) {
  auto rest = r.options;
  const auto subformat = take_create_option(rest, "subformat");
  const auto force_size = take_create_option(rest, "force_size");
  const auto preallocation = take_create_option(rest, "preallocation");
  QCOWFS_TRY(no_options_left(rest, "vpc"));
  Options o;
  o.path = r.path;
  if (force_size) {
    auto b = parse_create_bool("force_size", *force_size);
    if (!b) return b.status();
    o.force_size = *b;
  }
  if (!r.size) return Status::error(EINVAL, "Image creation needs a size parameter");
  if (!r.backing_file.empty()) return Status::error(EINVAL, "Backing file not supported for file format 'vpc'");
  if (subformat && *subformat != "dynamic" && *subformat != "fixed")
    return Status::errorf(EINVAL, "Parameter 'subformat' does not accept value '{}'", *subformat);
  o.fixed = subformat == "fixed";
  if (preallocation) QCOWFS_TRY(check_preallocation(*preallocation));
  o.formatting = fmt::format("fmt=vpc size={}", *r.size);
  if (subformat) o.formatting += fmt::format(" subformat={}", *subformat);
  if (force_size) o.formatting += fmt::format(" force_size={}", *force_size);
  if (preallocation) o.formatting += fmt::format(" preallocation={}", *preallocation);
  return resolve_size(std::move(o), *r.size);
}

// qemu_uuid_generate(): a random (version 4) UUID.
std::array<uint8_t, 16> random_uuid() {
  std::random_device rd;
  std::array<uint8_t, 16> u{};
  for (uint8_t& b : u) b = static_cast<uint8_t>(rd());
  u[6] = static_cast<uint8_t>((u[6] & 0x0f) | 0x40);
  u[8] = static_cast<uint8_t>((u[8] & 0x3f) | 0x80);
  return u;
}

class VpcCreator final : public Creator {
 public:
  explicit VpcCreator(Options o) : o_(std::move(o)) {}
  std::string formatting() const override { return o_.formatting; }
  Task<Status> write(NewFiles& files) override;

 private:
  Footer footer() const;
  Task<Status> write_dynamic(io::HostFile& f, std::span<const std::byte> footer) const;

  Options o_;
};

Footer VpcCreator::footer() const {
  Footer f;
  f.type = o_.fixed ? kFixed : kDynamic;
  f.data_offset = o_.fixed ? ~uint64_t{0} : kFooterSize;
  f.orig_size = f.current_size = o_.size;
  f.cyls = o_.geometry.cyls;
  f.heads = o_.geometry.heads;
  f.secs = o_.geometry.secs;
  const std::string_view app = o_.force_size ? "qem2" : "qemu";
  std::copy(app.begin(), app.end(), f.creator_app.begin());
  f.creator_ver = kCreatorVersion;
  const std::string_view os = "Wi2k";
  std::copy(os.begin(), os.end(), f.creator_os.begin());
  f.timestamp = static_cast<uint32_t>(static_cast<uint64_t>(std::time(nullptr)) - kTimestampBase);
  f.uuid = random_uuid();
  return f;
}

// create_dynamic_disk(): footer copy at 0, the header at 512, the BAT (all
// unallocated) at 1536, the footer after it.
Task<Status> VpcCreator::write_dynamic(io::HostFile& f, std::span<const std::byte> footer) const {
  const uint64_t entries = (o_.size / kSector + kNewBlockSize / kSector - 1) / (kNewBlockSize / kSector);
  const uint64_t bat_bytes = (entries * 4 + kSector - 1) / kSector * kSector;
  DynHeader h;
  h.table_offset = kNewTableOffset;
  h.max_table_entries = static_cast<uint32_t>(entries);
  h.block_size = kNewBlockSize;
  QCOWFS_CO_TRY(co_await f.write(0, footer));
  QCOWFS_CO_TRY(co_await f.write(kFooterSize, serialize_dyn_header(h)));
  const std::vector<std::byte> bat(bat_bytes, std::byte{0xff});
  QCOWFS_CO_TRY(co_await f.write(kNewTableOffset, bat));
  co_return co_await f.write(kNewTableOffset + bat_bytes, footer);
}

Task<Status> VpcCreator::write(NewFiles& files) {
  auto file = files.create(o_.path);
  if (!file) co_return file.status();
  io::HostFile& f = **file;
  const auto footer = serialize_footer(this->footer());
  if (o_.fixed) {
    QCOWFS_CO_TRY(co_await f.truncate(o_.size + kFooterSize));
    QCOWFS_CO_TRY(co_await f.write(o_.size, footer));
  } else {
    QCOWFS_CO_TRY(co_await write_dynamic(f, footer));
  }
  co_return co_await f.flush();
}

}  // namespace

Result<std::unique_ptr<Creator>> prepare_vpc_create(const CreateRequest& request) {
  auto o = parse_options(request);
  if (!o) return o.status().with_context(request.path);
  return std::unique_ptr<Creator>(std::make_unique<VpcCreator>(std::move(*o)));
}

}  // namespace qcowfs::image
