// qemu-img create -f vmdk (QEMU 7.2 block/vmdk.c): options as
// vmdk_co_create_opts() reads them, the refusals of vmdk_co_do_create(), the
// extent files named as vmdk_co_create_opts_cb() names them and each sparse
// extent laid out as vmdk_init_extent() lays it out: header, descriptor room
// (sectors 1-20), redundant grain directory and its grain tables, grain
// directory and its grain tables, data from the next 64 KiB boundary.
#include "image/vmdk/vmdk_create.h"

#include <array>
#include <cstdlib>
#include <limits>
#include <optional>
#include <random>
#include <vector>

#include "image/block_driver.h"
#include "image/endian.h"
#include "image/path.h"
#include "image/vmdk/descriptor.h"
#include "image/vmdk/format.h"

namespace qcowfs::image {
namespace {

using namespace vmdk;

enum class Subformat { monolithicSparse, monolithicFlat, twoGbMaxExtentSparse, twoGbMaxExtentFlat, streamOptimized };
constexpr std::array<std::string_view, 5> kSubformats = {"monolithicSparse", "monolithicFlat", "twoGbMaxExtentSparse",
                                                         "twoGbMaxExtentFlat", "streamOptimized"};
constexpr std::array<std::string_view, 4> kAdapterTypes = {"ide", "buslogic", "lsilogic", "legacyESX"};

constexpr uint64_t kSplitSize = 0x80000000;  // twoGbMaxExtent*: 2 GiB extents
// What vmdk_init_extent() writes: 64 KiB grains, 512-entry grain tables, the
// descriptor in sectors 1-20.
constexpr uint64_t kNewGranularity = 128;
constexpr uint32_t kNewGtes = 512;
constexpr uint64_t kNewDescOffset = 1, kNewDescSectors = 20;
constexpr uint32_t kNoParentCid = 0xffffffff;

struct Options {
  std::string path;
  uint64_t size = 0;  // bytes, a multiple of the sector
  Subformat subformat = Subformat::monolithicSparse;
  std::string adapter_type = "ide";
  std::string backing_file;
  std::string hw_version = "4";
  std::string tools_version = "2147483647";
  bool zeroed_grain = false;
  std::string formatting;

  bool flat() const { return subformat == Subformat::monolithicFlat || subformat == Subformat::twoGbMaxExtentFlat; }
  bool split() const {
    return subformat == Subformat::twoGbMaxExtentSparse || subformat == Subformat::twoGbMaxExtentFlat;
  }
  bool compress() const { return subformat == Subformat::streamOptimized; }
};

Status refuse(const std::string& path, int code, std::string_view msg) {
  return Status::errorf(code, "{}: {}", path, msg);
}

template <size_t N>
std::optional<size_t> index_of(const std::array<std::string_view, N>& names, std::string_view v) {
  for (size_t i = 0; i < N; ++i)
    if (names[i] == v) return i;
  return std::nullopt;
}

// The protocol layer's preallocation= (file-posix): accepted, and without
// effect on a VMDK (its files are created empty, then truncated).
Status check_preallocation(const std::string& path, std::string_view v) {
  if (v == "off" || v == "falloc" || v == "full") return Status::ok();
  if (v == "metadata") return refuse(path, EINVAL, "Unsupported preallocation mode: metadata");
  return refuse(path, EINVAL, fmt::format("invalid parameter value: {}", v));
}

// The qemu-img options in the order qemu-img's "Formatting" line lists them.
struct Given {
  std::optional<std::string> adapter_type, compat6, hwversion, toolsversion, subformat, zeroed_grain, preallocation;
};

std::string formatting_of(const CreateRequest& r, const Given& g) {
  std::string s = fmt::format("fmt=vmdk size={}", *r.size);
  auto add = [&s](std::string_view key, const std::optional<std::string>& v) {
    if (v) s += fmt::format(" {}={}", key, *v);
  };
  add("adapter_type", g.adapter_type);
  if (!r.backing_file.empty()) s += fmt::format(" backing_file={}", r.backing_file);
  if (!r.backing_format.empty()) s += fmt::format(" backing_fmt={}", r.backing_format);
  s += fmt::format(" compat6={} hwversion={}", g.compat6.value_or("off"), g.hwversion.value_or("undefined"));
  add("toolsversion", g.toolsversion);
  add("subformat", g.subformat);
  add("zeroed_grain", g.zeroed_grain);
  add("preallocation", g.preallocation);
  return s;
}

Result<bool> bool_option(const std::optional<std::string>& v, std::string_view key) {
  if (!v) return false;
  return parse_create_bool(key, *v);
}

// vmdk_co_create_opts() and vmdk_co_do_create()'s checks, in their order.
Result<Options> parse_options(const CreateRequest& r) {
  auto rest = r.options;
  Given g;
  g.adapter_type = take_create_option(rest, "adapter_type");
  g.compat6 = take_create_option(rest, "compat6");
  g.hwversion = take_create_option(rest, "hwversion");
  g.toolsversion = take_create_option(rest, "toolsversion");
  g.subformat = take_create_option(rest, "subformat");
  g.zeroed_grain = take_create_option(rest, "zeroed_grain");
  g.preallocation = take_create_option(rest, "preallocation");
  QCOWFS_TRY(no_options_left(rest, "vmdk"));
  auto compat6 = bool_option(g.compat6, "compat6");
  if (!compat6) return compat6.status();
  auto zeroed = bool_option(g.zeroed_grain, "zeroed_grain");
  if (!zeroed) return zeroed.status();
  Options o;
  o.path = r.path;
  if (!r.size) return refuse(o.path, EINVAL, "Image creation needs a size parameter");
  if (*r.size > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) - (kSector - 1))
    return refuse(o.path, EFBIG, "Image size must be less than 8 EiB!");
  o.size = (*r.size + kSector - 1) / kSector * kSector;
  if (!r.backing_format.empty() && r.backing_format != "vmdk")
    return refuse(o.path, EINVAL, "backing_file must be a vmdk image");
  o.backing_file = r.backing_file;
  if (g.adapter_type) {
    if (!index_of(kAdapterTypes, *g.adapter_type))
      return refuse(o.path, EINVAL, fmt::format("invalid parameter value: {}", *g.adapter_type));
    o.adapter_type = *g.adapter_type;
  }
  if (g.subformat) {
    auto i = index_of(kSubformats, *g.subformat);
    if (!i) return refuse(o.path, EINVAL, fmt::format("invalid parameter value: {}", *g.subformat));
    o.subformat = static_cast<Subformat>(*i);
  }
  const bool hw_given = g.hwversion && *g.hwversion != "undefined";
  if (*compat6 && hw_given) return refuse(o.path, EINVAL, "compat6 cannot be enabled with hwversion set");
  if (*compat6) o.hw_version = "6";
  if (hw_given) o.hw_version = *g.hwversion;
  if (g.toolsversion) o.tools_version = *g.toolsversion;
  o.zeroed_grain = *zeroed;
  if (o.flat() && !o.backing_file.empty()) return refuse(o.path, ENOTSUP, "Flat image can't have backing file");
  if (o.flat() && o.zeroed_grain) return refuse(o.path, ENOTSUP, "Flat image can't enable zeroed grain");
  if (o.backing_file.size() > kMaxParentHint)
    return refuse(o.path, ENAMETOOLONG, "the backing file name is too long for parentFileNameHint");
  if (g.preallocation) QCOWFS_TRY(check_preallocation(o.path, *g.preallocation));
  o.formatting = formatting_of(r, g);
  return o;
}

// ---- writing ----

// A sparse extent's header, as vmdk_init_extent() fills it for `bytes` of disk.
SparseHeader new_sparse_header(uint64_t bytes, bool compress, bool zeroed_grain) {
  SparseHeader h;
  h.version = compress ? 3 : zeroed_grain ? 2 : 1;
  h.flags = kFlagRedundantGd | kFlagNewlineDetect | (compress ? kFlagCompressed | kFlagMarkers : 0) |
            (zeroed_grain ? kFlagZeroGrain : 0);
  h.compress_algorithm = compress ? kCompressionDeflate : 0;
  h.capacity = bytes / kSector;
  h.granularity = kNewGranularity;
  h.num_gtes_per_gt = kNewGtes;
  const uint64_t grains = (h.capacity + h.granularity - 1) / h.granularity;
  const uint64_t gt_sectors = kNewGtes * 4 / kSector;
  h.gd_entries = (grains + kNewGtes - 1) / kNewGtes;
  const uint64_t gd_sectors = (h.gd_entries * 4 + kSector - 1) / kSector;
  h.desc_offset = kNewDescOffset;
  h.desc_size = kNewDescSectors;
  h.rgd_offset = h.desc_offset + h.desc_size;
  h.gd_offset = h.rgd_offset + gd_sectors + gt_sectors * h.gd_entries;
  const uint64_t end = h.gd_offset + gd_sectors + gt_sectors * h.gd_entries;
  h.grain_offset = (end + h.granularity - 1) / h.granularity * h.granularity;
  return h;
}

// A grain directory at `gd` naming the grain tables that follow it.
std::vector<std::byte> grain_directory(const SparseHeader& h, uint64_t gd) {
  const uint64_t gd_sectors = (h.gd_entries * 4 + kSector - 1) / kSector;
  std::vector<std::byte> b(gd_sectors * kSector);
  uint64_t gt = gd + gd_sectors;
  for (uint64_t i = 0; i < h.gd_entries; ++i, gt += kNewGtes * 4 / kSector)
    store_le32(b.data() + i * 4, static_cast<uint32_t>(gt));
  return b;
}

// vmdk_init_extent() for a sparse extent: header, room up to the first grain
// (the grain tables read as zeros: unallocated), both grain directories.
Task<Status> write_sparse_extent(io::HostFile& f, uint64_t bytes, bool compress, bool zeroed_grain) {
  const SparseHeader h = new_sparse_header(bytes, compress, zeroed_grain);
  if (h.gd_entries > kMaxGdEntries)
    co_return Status::errorf(EFBIG, "{}: a grain directory of {} entries is more than the {} qcowfs opens", f.path(),
                             h.gd_entries, kMaxGdEntries);
  const auto header = serialize_sparse_header(h);
  QCOWFS_CO_TRY(co_await f.write(0, header));
  QCOWFS_CO_TRY(co_await f.truncate(h.grain_offset * kSector));
  for (uint64_t gd : {h.rgd_offset, h.gd_offset}) {
    const auto dir = grain_directory(h, gd);
    QCOWFS_CO_TRY(co_await f.write(gd * kSector, dir));
  }
  co_return Status::ok();
}

// filename_decompose(): the directory (with its separator), the base name up
// to its last dot, and the rest ("disk", ".vmdk").
struct NameParts {
  std::string dir, prefix, postfix;
};
NameParts decompose(const std::string& path) {
  NameParts n;
  size_t sep = path.rfind('/');
  if (sep == std::string::npos) sep = path.rfind('\\');
  if (sep == std::string::npos) sep = path.rfind(':');
  const size_t base = sep == std::string::npos ? 0 : sep + 1;
  n.dir = path.substr(0, base);
  const size_t dot = path.rfind('.');
  const size_t stem_end = dot == std::string::npos || dot < base ? path.size() : dot;
  n.prefix = path.substr(base, stem_end - base);
  n.postfix = path.substr(stem_end);
  return n;
}

std::string base_name(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

// vmdk_desc_add_extent(): the extent's line in the descriptor.
std::string extent_line(bool flat, uint64_t bytes, const std::string& file) {
  if (flat) return fmt::format("RW {} FLAT \"{}\" 0\n", bytes / kSector, base_name(file));
  return fmt::format("RW {} SPARSE \"{}\"\n", bytes / kSector, base_name(file));
}

// The parent's CID (vmdk_read_cid() on the parent opened without its own parent).
Task<Result<uint32_t>> read_parent_cid(const std::string& image, const std::string& backing) {
  ImageOptions opts;
  opts.format = "vmdk";
  opts.no_backing = true;
  auto parent = co_await open_image(resolve_relative(image, backing), opts);
  if (!parent) co_return parent.status().with_context(fmt::format("{}: opening the parent '{}'", image, backing));
  std::optional<uint64_t> cid;
  const ImageDetails details = (*parent)->details();
  for (const auto& [key, value] : details.specific.members())
    if (key == "cid") cid = std::strtoull(value.scalar_text().c_str(), nullptr, 10);
  QCOWFS_CO_TRY(co_await (*parent)->close());
  if (!cid) co_return refuse(image, EINVAL, "Failed to read parent CID");
  co_return static_cast<uint32_t>(*cid);
}

class VmdkCreator final : public Creator {
 public:
  explicit VmdkCreator(Options o) : o_(std::move(o)) {}
  std::string formatting() const override { return o_.formatting; }
  std::vector<std::string> extra_paths() const override;
  Task<Status> write(NewFiles& files) override;

 private:
  std::string descriptor(uint32_t parent_cid, const std::string& extent_lines) const;
  Task<Result<std::string>> write_extent_files(NewFiles& files);

  Options o_;
};

std::string VmdkCreator::descriptor(uint32_t parent_cid, const std::string& extent_lines) const {
  const uint32_t heads = o_.adapter_type == "ide" ? 16 : 255;
  const std::string parent_line =
      o_.backing_file.empty() ? "" : fmt::format("parentFileNameHint=\"{}\"", o_.backing_file);
  return fmt::format(
      "# Disk DescriptorFile\nversion=1\nCID={:x}\nparentCID={:x}\ncreateType=\"{}\"\n{}\n"
      "# Extent description\n{}\n# The Disk Data Base\n#DDB\n\n"
      "ddb.virtualHWVersion = \"{}\"\nddb.geometry.cylinders = \"{}\"\nddb.geometry.heads = \"{}\"\n"
      "ddb.geometry.sectors = \"63\"\nddb.adapterType = \"{}\"\nddb.toolsVersion = \"{}\"\n",
      std::random_device{}(), parent_cid, kSubformats[static_cast<size_t>(o_.subformat)], parent_line, extent_lines,
      o_.hw_version, o_.size / (63 * heads * kSector), heads, o_.adapter_type, o_.tools_version);
}

// The extent files of a descriptor file (monolithicFlat, twoGbMaxExtent*),
// named as qemu-img names them: disk-flat.vmdk, disk-s001.vmdk, disk-f001.vmdk...
std::vector<std::string> VmdkCreator::extra_paths() const {
  std::vector<std::string> names;
  if (!o_.split() && !o_.flat()) return names;
  const NameParts n = decompose(o_.path);
  const uint64_t extent_size = o_.split() ? kSplitSize : o_.size;
  uint64_t covered = 0;
  for (int idx = 1; covered < o_.size; ++idx) {
    names.push_back(o_.split() ? fmt::format("{}{}-{}{:03}{}", n.dir, n.prefix, o_.flat() ? 'f' : 's', idx, n.postfix)
                               : fmt::format("{}{}-flat{}", n.dir, n.prefix, n.postfix));
    covered += std::min(o_.size - covered, extent_size);
  }
  return names;
}

// Makes the extent files (extra_paths()); returns their extent lines.
Task<Result<std::string>> VmdkCreator::write_extent_files(NewFiles& files) {
  const uint64_t extent_size = o_.split() ? kSplitSize : o_.size;
  std::string lines;
  uint64_t created = 0;
  for (const std::string& name : extra_paths()) {
    const uint64_t bytes = std::min(o_.size - created, extent_size);
    auto f = files.create(name);
    if (!f) co_return f.status();
    if (o_.flat())
      QCOWFS_CO_TRY(co_await (*f)->truncate(bytes));
    else
      QCOWFS_CO_TRY(co_await write_sparse_extent(**f, bytes, false, o_.zeroed_grain));
    QCOWFS_CO_TRY(co_await (*f)->flush());
    lines += extent_line(o_.flat(), bytes, name);
    created += bytes;
  }
  co_return lines;
}

Task<Status> VmdkCreator::write(NewFiles& files) {
  auto image = files.create(o_.path);
  if (!image) co_return image.status();
  io::HostFile& top = **image;
  const bool monolithic = !o_.split() && !o_.flat();
  std::string lines;
  if (monolithic) {
    QCOWFS_CO_TRY(co_await write_sparse_extent(top, o_.size, o_.compress(), o_.zeroed_grain));
    lines = extent_line(false, o_.size, o_.path);
  }
  uint32_t parent_cid = kNoParentCid;
  if (!o_.backing_file.empty()) {
    auto cid = co_await read_parent_cid(o_.path, o_.backing_file);
    if (!cid) co_return cid.status();
    parent_cid = *cid;
  }
  if (!monolithic) {
    auto extents = co_await write_extent_files(files);
    if (!extents) co_return extents.status();
    lines = std::move(*extents);
  }
  const std::string text = descriptor(parent_cid, lines);
  const auto bytes = std::as_bytes(std::span(text));
  if (monolithic) {
    if (text.size() > kNewDescSectors * kSector)
      co_return refuse(o_.path, ENAMETOOLONG, "the descriptor is larger than the 10 KiB kept for it");
    QCOWFS_CO_TRY(co_await top.write(kNewDescOffset * kSector, bytes));
  } else {
    QCOWFS_CO_TRY(co_await top.write(0, bytes));
    QCOWFS_CO_TRY(co_await top.truncate(text.size()));
  }
  co_return co_await top.flush();
}

}  // namespace

Result<std::unique_ptr<Creator>> prepare_vmdk_create(const CreateRequest& request) {
  auto o = parse_options(request);
  if (!o) return o.status();
  return std::unique_ptr<Creator>(std::make_unique<VmdkCreator>(std::move(*o)));
}

}  // namespace qcowfs::image
