// VMDK opening (QEMU 7.2 block/vmdk.c: vmdk_open, vmdk_open_vmdk4,
// vmdk_open_vmfs_sparse, vmdk_parse_extents, vmdk_parent_open, vmdk_read_cid,
// vmdk_get_specific_info); the map is in map.cc.
#include "image/vmdk/vmdk.h"

#include <limits.h>
#include <stdlib.h>

#include <algorithm>
#include <cstring>

#include "image/backing.h"
#include "image/endian.h"
#include "image/extent/driver.h"
#include "image/extent/host_read.h"
#include "image/path.h"
#include "image/extent/table_cache.h"
#include "image/vmdk/descriptor.h"
#include "image/vmdk/format.h"
#include "image/vmdk/map.h"
#include "image/vmdk/vmdk_check.h"
#include "image/vmdk/writer.h"

namespace qcowfs::image {
namespace {

using namespace vmdk;

constexpr uint64_t kMaxSectors = static_cast<uint64_t>(INT64_MAX) / kSector;

// n bytes at off, zeros past the end of the file (image/extent/host_read.h).
Task<Result<std::vector<std::byte>>> read_bytes(io::HostFile& f, uint64_t off, size_t n) {
  std::vector<std::byte> b(n);
  Status st = co_await image::read_padded(f, off, b);
  if (!st) co_return st.with_context(fmt::format("reading {}", f.path()));
  co_return b;
}

std::string real_path(const std::string& path) {
  char buf[PATH_MAX];
  if (::realpath(path.c_str(), buf) == nullptr) return path;
  return buf;
}

struct Opening {
  std::string path;  // the image the user named (the descriptor)
  ImageOptions opts;
  std::vector<HostFileState> files;  // files[0]: the image file
  std::vector<VExtent> extents;
  uint64_t total = 0;  // guest bytes so far
  // GD entries held in memory by all extents: at most kMaxGdEntries in all,
  // so many extents naming one large file cannot multiply the memory.
  uint64_t gd_entries = 0;
  std::string create_type;
  bool have_create_type = false;
  bool top_sparse = false;  // the image file is a sparse extent (its descriptor embedded)
};

Status add_extent(Opening& o, VExtent x, uint64_t sectors) {
  if (sectors > kMaxSectors || o.total / kSector + sectors > kMaxSectors)
    return Status::errorf(EFBIG, "{}: extent '{}' makes the disk larger than 2^63 bytes", o.path, x.filename);
  x.start = o.total;
  x.size = sectors * kSector;
  o.total += x.size;
  if (x.size > 0) o.extents.push_back(std::move(x));
  return Status::ok();
}

// The streamOptimized footer: the header that counts when the GD is at the end.
Task<Result<SparseHeader>> read_footer(io::HostFile& f, const std::string& name) {
  uint64_t rounded = (f.size() + kSector - 1) / kSector * kSector;
  if (rounded < kFooterBytes) co_return Status::errorf(EINVAL, "{}: too small for a stream footer", name);
  auto b = co_await read_bytes(f, rounded - kFooterBytes, kFooterBytes);
  if (!b) co_return b.status();
  const std::byte* p = b->data();
  const std::byte* eos = p + 2 * kSector;
  if (load_be32(p + kSector) != kVmdk4MagicBe || load_le32(p + kMarkerSize) != 0 ||
      load_le32(p + kMarkerType) != kMarkerFooter || load_le64(eos + kMarkerValue) != 0 ||
      load_le32(eos + kMarkerSize) != 0 || load_le32(eos + kMarkerType) != kMarkerEndOfStream)
    co_return Status::errorf(EINVAL, "{}: invalid stream footer", name);
  co_return parse_sparse_header(std::span(*b).subspan(kSector, kSector));
}

// The sectors one GD entry maps, as QEMU computes it (l1_entry_sectors, 32 bits).
uint32_t gd_coverage_sectors(const SparseHeader& h) {
  return static_cast<uint32_t>(uint64_t{h.num_gtes_per_gt} * h.granularity);
}

Status check_sparse(const SparseHeader& h, uint64_t file_size, const std::string& name) {
  if (!h.vmdk3) {
    if (h.version > kMaxVersion) return Status::errorf(ENOTSUP, "{}: unsupported VMDK version {}", name, h.version);
    if (h.num_gtes_per_gt > kMaxGtesPerGt)
      return Status::errorf(EINVAL, "{}: grain tables of {} entries are too big (at most {})", name, h.num_gtes_per_gt,
                            kMaxGtesPerGt);
  }
  // QEMU refuses this for KDMV and divides by it for COWD.
  if (gd_coverage_sectors(h) == 0)
    return Status::errorf(EINVAL, "{}: invalid grain directory entry coverage (grain size {}, {} entries)", name,
                          h.granularity, h.num_gtes_per_gt);
  if (!h.vmdk3) {
    if ((file_size + kSector - 1) / kSector < h.grain_offset)
      return Status::errorf(EINVAL, "{}: file truncated, expecting at least {} bytes", name, h.grain_offset * kSector);
  }
  if (h.granularity > kMaxGrainSectors)
    return Status::errorf(EFBIG, "{}: invalid grain size {} sectors, image may be corrupt", name, h.granularity);
  if (h.capacity > kMaxSectors) return Status::errorf(EFBIG, "{}: capacity {} sectors is absurd", name, h.capacity);
  if (h.gd_offset > kMaxSectors)
    return Status::errorf(EINVAL, "{}: grain directory offset {} is absurd", name, h.gd_offset);
  return Status::ok();
}

// A grain directory's entries inside the file (the rest read as 0).
Task<Status> load_gd(const VExtent& x, uint64_t gd_sector, std::vector<uint32_t>& gd) {
  io::HostFile& f = *x.file;
  uint64_t at = gd_sector * kSector;
  uint64_t inside = at >= f.size() ? 0 : std::min<uint64_t>(x.gd_size, (f.size() - at) / 4);
  if (inside == 0) co_return Status::ok();
  auto b = co_await read_bytes(f, at, static_cast<size_t>(inside * 4));
  if (!b) co_return b.status().with_context("reading the grain directory");
  gd.resize(inside);
  for (uint64_t i = 0; i < inside; ++i) gd[i] = load_le32(b->data() + i * 4);
  co_return Status::ok();
}

Task<Status> prepare_tables(HostFileState& s, uint64_t gt_bytes) {
  if (s.cache) co_return Status::ok();
  io::HostFile& f = *s.file;
  s.cache = std::make_unique<TableCache>(f, kGtWindow, TableCache::default_size(gt_bytes, kGtWindow));
  if (f.size() % kGtWindow != 0) {
    s.tail_slice = f.size() / kGtWindow * kGtWindow;
    auto b = co_await read_bytes(f, s.tail_slice, kGtWindow);
    if (!b) co_return b.status();
    s.tail_bytes = std::move(*b);
  }
  co_return Status::ok();
}

Task<Status> open_descriptor(Opening& o, std::string_view text, int depth);

// A SPARSE (or top-level) extent file: KDMV or COWD.
Task<Status> open_sparse(Opening& o, size_t file_index, std::string type, std::string filename, int depth) {
  HostFileState& s = o.files[file_index];
  io::HostFile& f = *s.file;
  auto head = co_await read_bytes(f, 0, kSector);
  if (!head) co_return head.status();
  uint32_t magic = load_be32(head->data());
  if (magic != kVmdk4MagicBe && magic != kVmdk3MagicBe)
    co_return Status::errorf(EINVAL, "{}: extent '{}' is not in VMDK format", o.path, filename);
  SparseHeader h = parse_sparse_header(*head);
  if (!h.vmdk3 && h.capacity == 0 && h.desc_offset != 0) {
    if (depth > 0)
      co_return Status::errorf(EINVAL, "{}: sparse extent '{}' holds a descriptor of its own (refused)", o.path,
                               filename);
    if (h.desc_offset > kMaxSectors) co_return Status::errorf(EINVAL, "{}: descriptor offset is absurd", o.path);
    auto text = co_await read_bytes(f, h.desc_offset * kSector,
                                     static_cast<size_t>(std::min<uint64_t>(f.size(), kMaxDescriptorBytes)));
    if (!text) co_return text.status();
    co_return co_await open_descriptor(o, std::string_view(reinterpret_cast<const char*>(text->data()), text->size()),
                                       depth + 1);
  }
  if (!o.have_create_type) {
    o.create_type = h.vmdk3 ? "" : "monolithicSparse";
    o.have_create_type = true;
  }
  if (!h.vmdk3 && h.gd_offset == kGdAtEnd) {
    auto footer = co_await read_footer(f, filename);
    if (!footer) co_return footer.status();
    h = *footer;
  }
  QCOWFS_CO_TRY(check_sparse(h, f.size(), filename));
  VExtent x;
  x.file = &f;
  x.type = std::move(type);
  x.filename = filename;
  x.grain_bytes = h.granularity * kSector;
  x.gtes = h.num_gtes_per_gt;
  uint64_t coverage_sectors = gd_coverage_sectors(h);
  x.gd_coverage = coverage_sectors * kSector;
  uint64_t gd_size =
      h.vmdk3 ? h.gd_entries : static_cast<uint32_t>((h.capacity + coverage_sectors - 1) / coverage_sectors);
  if (gd_size > kMaxGdEntries)
    co_return Status::errorf(EFBIG, "{}: grain directory of {} entries is too big", filename, gd_size);
  x.gd_size = static_cast<uint32_t>(gd_size);
  if (!h.vmdk3) {
    x.compressed = h.compress_algorithm == kCompressionDeflate;
    x.markers = (h.flags & kFlagMarkers) != 0;
    x.zero_grain = (h.flags & kFlagZeroGrain) != 0;
    if (x.compressed) o.create_type = "streamOptimized";
    if (x.compressed && h.granularity > kMaxCompressedGrainSectors)
      co_return Status::errorf(EFBIG, "{}: compressed grains of {} sectors are larger than the {} qcowfs reads",
                               filename, h.granularity, kMaxCompressedGrainSectors);
  }
  x.vmdk3 = h.vmdk3;
  x.gd_offset = h.gd_offset * kSector;
  x.grain_offset = h.grain_offset * kSector;
  if (h.desc_offset != 0 && h.desc_offset <= kMaxSectors) {
    x.desc_offset = h.desc_offset * kSector;
    x.desc_size = std::min<uint64_t>(h.desc_size, kMaxDescriptorBytes / kSector) * kSector;
  }
  QCOWFS_CO_TRY(co_await load_gd(x, h.gd_offset, x.gd));
  if (!h.vmdk3 && (h.flags & kFlagRedundantGd) != 0 && o.opts.file.writable) {
    if (h.rgd_offset == 0 || h.rgd_offset > kMaxSectors)
      co_return Status::errorf(EINVAL, "{}: redundant grain directory offset {} is absurd", filename, h.rgd_offset);
    x.rgd_offset = h.rgd_offset * kSector;
    QCOWFS_CO_TRY(co_await load_gd(x, h.rgd_offset, x.rgd));
  }
  o.gd_entries += x.gd.size();
  if (o.gd_entries > kMaxGdEntries)
    co_return Status::errorf(EFBIG, "{}: the grain directories of all extents hold more than {} entries", o.path,
                             kMaxGdEntries);
  QCOWFS_CO_TRY(co_await prepare_tables(s, uint64_t{x.gd_size} * x.gtes * 4));
  x.cache = s.cache.get();
  co_return add_extent(o, std::move(x), h.capacity);
}

// The file an extent line names, opened once per real path.
Result<size_t> extent_file(Opening& o, const std::string& resolved, const std::string& line_name) {
  std::string real = real_path(resolved);
  if (real == real_path(o.path))
    return Status::errorf(ELOOP, "{}: extent '{}' is the descriptor itself", o.path, line_name);
  for (size_t i = 1; i < o.files.size(); ++i)
    if (real_path(o.files[i].file->path()) == real) return i;
  auto f = io::open_host_file(resolved, o.opts.file);
  if (!f) return f.status().with_context(fmt::format("{}: opening extent '{}'", o.path, resolved));
  HostFileState s;
  s.owned = std::move(*f);
  s.file = s.owned.get();
  o.files.push_back(std::move(s));
  return o.files.size() - 1;
}

Task<Status> open_descriptor(Opening& o, std::string_view text, int depth) {
  auto ct = descriptor_create_type(text);
  if (!ct) co_return ct.status().with_context(o.path);
  o.create_type = *ct;
  o.have_create_type = true;
  auto lines = descriptor_extents(text);
  if (!lines) co_return lines.status().with_context(o.path);
  for (const DescriptorExtent& l : *lines) {
    if (l.type == "SESPARSE") co_return Status::errorf(ENOTSUP, "{}: seSparse extents are not supported", o.path);
    std::string resolved = resolve_relative(o.path, l.file);
    auto idx = extent_file(o, resolved, l.file);
    if (!idx) co_return idx.status();
    if (l.type == "FLAT" || l.type == "VMFS") {
      if (static_cast<uint64_t>(l.flat_offset) > kMaxSectors)
        co_return Status::errorf(EINVAL, "{}: extent '{}' has an absurd offset", o.path, l.file);
      VExtent x;
      x.file = o.files[*idx].file;
      x.flat = true;
      x.flat_offset = static_cast<uint64_t>(l.flat_offset) * kSector;
      x.type = l.type;
      x.filename = resolved;
      QCOWFS_CO_TRY(add_extent(o, std::move(x), static_cast<uint64_t>(l.sectors)));
    } else {
      QCOWFS_CO_TRY(co_await open_sparse(o, *idx, l.type, resolved, depth));
    }
  }
  co_return Status::ok();
}

bool same_kind(const VExtent& a, const VExtent& b) {
  return a.flat == b.flat && a.compressed == b.compressed && (a.flat || a.grain_bytes == b.grain_bytes);
}

ImageDetails details_of(const Opening& o, uint32_t cid, uint32_t parent_cid) {
  ImageDetails d;
  bool uniform = true;
  for (const VExtent& x : o.extents) uniform = uniform && same_kind(o.extents.front(), x);
  if (uniform && !o.extents.empty()) {
    d.dirty = false;
    if (!o.extents.front().flat) d.cluster_size = o.extents.front().grain_bytes;
  }
  Json data = Json::object();
  data.set("cid", uint64_t{cid});
  data.set("parent-cid", uint64_t{parent_cid});
  data.set("create-type", o.create_type);
  Json extents = Json::array();
  for (const VExtent& x : o.extents) {
    Json e = Json::object();
    if (x.compressed) e.set("compressed", true);
    e.set("virtual-size", x.size);
    e.set("filename", x.filename);
    if (!x.flat) e.set("cluster-size", x.grain_bytes);
    e.set("format", x.type);
    extents.push(std::move(e));
  }
  data.set("extents", std::move(extents));
  d.specific = std::move(data);
  return d;
}

// A delta whose parentCID is not its parent's CID: its parent was written
// after the delta was made, so the delta's grains over the parent's current
// data are a disk no VM ever wrote. Refused at open (VMware refuses it too;
// QEMU opens it and fails every read that reaches the parent, EINVAL).
Status stale_parent(const Opening& o, const std::string& parent, uint32_t parent_cid, uint32_t cid) {
  return Status::errorf(EINVAL,
                        "{}: its parent {} was modified since the delta was created (parentCID {:08x}, parent's "
                        "CID {:08x}), so the delta no longer applies to it (VMware refuses it, QEMU fails its "
                        "reads); restore the parent, or set the delta's parentCID to {:08x} to use the mixture "
                        "anyway",
                        o.path, parent, parent_cid, cid, cid);
}

// The CID of an opened parent (its info's "cid"); nullopt when it is not a
// VMDK image (QEMU: "it does not have a CID", never valid).
std::optional<uint32_t> cid_of(const BlockDriver& d) {
  if (d.format_name() != "vmdk") return std::nullopt;
  const ImageDetails details = d.details();
  for (const auto& [k, v] : details.specific.members())
    if (k == "cid") return static_cast<uint32_t>(std::strtoull(v.scalar_text().c_str(), nullptr, 10));
  return std::nullopt;
}

// The CID QEMU's vmdk_read_cid() reads of the parent file without opening it
// as an image (the descriptor at 0x200 of a sparse file, else at 0): for an
// open without the parent (info). nullopt when the parent cannot be read, so
// that info still describes a delta whose parent is missing, as qemu-img does.
Task<std::optional<uint32_t>> peek_cid(const Opening& o, const std::string& parent) {
  io::OpenOptions fo = o.opts.file;
  fo.writable = false;
  auto f = io::open_host_file(parent, fo);
  if (!f) co_return std::nullopt;
  auto head = co_await read_bytes(**f, 0, 4);
  if (!head) co_return std::nullopt;
  uint32_t magic = load_be32(head->data());
  bool sparse = magic == kVmdk4MagicBe || magic == kVmdk3MagicBe;
  auto text = co_await read_bytes(**f, sparse ? kDescOffsetInSparse : 0, kDescWindow);
  if (!text) co_return std::nullopt;
  auto cid = descriptor_cid(std::string_view(reinterpret_cast<const char*>(text->data()), text->size()), false);
  if (!cid) co_return std::nullopt;
  co_return *cid;
}

// The parent, refused when its CID is not the delta's parentCID. QEMU checks
// every level of a chain against its own parent; so do we, as each delta of
// the chain opens its parent.
Task<Result<std::unique_ptr<BlockDriver>>> open_parent(const Opening& o, const std::string& hint, uint32_t parent_cid) {
  auto b = co_await open_backing_file(o.path, hint, "vmdk", o.opts, false);  // the CID is checked now
  if (!b) co_return b.status();
  const std::string parent = resolve_relative(o.path, hint);
  auto cid = cid_of(**b);
  if (!cid) co_return Status::errorf(EINVAL, "{}: its parent {} is not a VMDK image and has no CID", o.path, parent);
  if (*cid != parent_cid) {
    Status st = stale_parent(o, parent, parent_cid, *cid);
    (void)co_await (*b)->close();
    co_return st;
  }
  co_return std::move(*b);
}

// Opens the image file's extents (it is a sparse extent or a descriptor);
// returns the text QEMU reads CID, parentCID and the parent hint from.
Task<Result<std::string>> open_extents(Opening& o) {
  io::HostFile& f = *o.files[0].file;
  auto head = co_await read_bytes(f, 0, 4);
  if (!head) co_return head.status();
  uint32_t magic = load_be32(head->data());
  bool sparse = magic == kVmdk4MagicBe || magic == kVmdk3MagicBe;
  o.top_sparse = sparse;
  if (sparse) QCOWFS_CO_TRY(co_await open_sparse(o, 0, "", o.path, 0));
  uint64_t at = sparse ? kDescOffsetInSparse : 0;
  size_t n = sparse ? kDescWindow : static_cast<size_t>(std::min<uint64_t>(f.size(), kMaxDescriptorBytes));
  auto text = co_await read_bytes(f, at, n);
  if (!text) co_return text.status();
  std::string window(reinterpret_cast<const char*>(text->data()), text->size());
  if (!sparse) QCOWFS_CO_TRY(co_await open_descriptor(o, window, 0));
  if (o.extents.empty()) co_return Status::errorf(EINVAL, "{}: VMDK image has no extents", o.path);
  co_return window;
}

// The ExtentImage of the opened extents, with the parent unless no_backing;
// refused when the parent changed since the delta was made (also without it,
// when its CID can be read).
Task<Result<ExtentImage>> image_of(Opening& o, const std::string& window) {
  auto hint = descriptor_parent_hint(window);
  if (!hint) co_return hint.status().with_context(o.path);
  auto cid = descriptor_cid(window, false);
  if (!cid) co_return cid.status().with_context(o.path);
  auto parent_cid = descriptor_cid(window, true);
  if (!parent_cid) co_return parent_cid.status().with_context(o.path);
  ExtentImage img;
  img.format = "vmdk";
  img.path = o.path;
  img.size = o.total;
  img.details = details_of(o, *cid, *parent_cid);
  for (const VExtent& x : o.extents)
    if (x.compressed) img.compressed_unit_size = std::max(img.compressed_unit_size, x.grain_bytes);
  if (*hint) {
    img.details.backing_file = **hint;
    img.details.backing_format = "vmdk";
    if (!o.opts.no_backing) {
      auto b = co_await open_parent(o, **hint, *parent_cid);
      if (!b) co_return b.status();
      img.backing = std::move(*b);
    } else {
      const std::string parent = resolve_relative(o.path, **hint);
      auto actual = co_await peek_cid(o, parent);
      if (actual && *actual != *parent_cid) co_return stale_parent(o, parent, *parent_cid, *actual);
    }
  }
  co_return img;
}

// Where QEMU's vmdk_write_cid() rewrites the CID: the descriptor file, or the
// descriptor at 0x200 of a sparse image file, which must be the one its
// header names (QEMU writes 0x200 whatever the header says).
Result<DescriptorPlace> descriptor_place(const Opening& o) {
  DescriptorPlace p;
  p.file = o.files[0].file;
  if (!o.top_sparse) {
    if (p.file->size() > kMaxDescriptorBytes)
      return Status::errorf(EROFS, "{}: the descriptor file is larger than {} bytes; mount it read-only", o.path,
                            kMaxDescriptorBytes);
    return p;
  }
  for (const VExtent& x : o.extents)
    if (x.file == p.file && !x.flat && x.desc_offset == kDescOffsetInSparse && x.desc_size > 0) {
      p.whole_file = false;
      p.offset = x.desc_offset;
      p.size = x.desc_size;
      return p;
    }
  return Status::errorf(EROFS,
                        "{}: the embedded descriptor is not at sector 1, where QEMU updates its CID; mount it "
                        "read-only",
                        o.path);
}

// What open_vmdk() and open_for_check() share: the extents of the image in
// o.files[0] and the ExtentImage over them (the parent opened).
Task<Result<ExtentImage>> open_read(Opening& o) {
  auto chain = enter_backing_chain(o.path, o.opts);
  if (!chain) co_return chain.status();
  if (o.files[0].file->size() < 4)
    co_return Status::errorf(EINVAL, "{}: file is too small to be a VMDK image", o.path);
  auto window = co_await open_extents(o);
  if (!window) co_return window.status();
  co_return co_await image_of(o, *window);
}

}  // namespace

Task<Result<vmdk::OpenedForCheck>> vmdk::open_for_check(io::HostFile& file, std::string path, ImageOptions opts) {
  Opening o;
  o.path = std::move(path);
  o.opts = std::move(opts);
  o.opts.file.writable = false;
  HostFileState top;
  top.file = &file;
  o.files.push_back(std::move(top));
  auto img = co_await open_read(o);
  if (!img) co_return img.status();
  OpenedForCheck opened;
  opened.extents = std::move(o.extents);
  opened.files = std::move(o.files);
  opened.parent = std::move(img->backing);
  opened.size = img->size;
  co_return opened;
}

Task<Result<std::unique_ptr<BlockDriver>>> open_vmdk(std::unique_ptr<io::HostFile> file, std::string path,
                                                     ImageOptions opts) {
  Opening o;
  o.path = path;
  o.opts = std::move(opts);
  HostFileState top;
  top.file = file.get();
  top.owned = std::move(file);
  o.files.push_back(std::move(top));
  auto img = co_await open_read(o);
  if (!img) co_return img.status();
  std::optional<DescriptorPlace> place;
  uint64_t grain = 0;
  if (o.opts.file.writable) {
    auto g = co_await check_writable(path, o.extents);
    if (!g) co_return g.status();
    grain = *g;
    auto p = descriptor_place(o);
    if (!p) co_return p.status();
    place = *p;
  }
  // The image owns the files; the map their grain-table caches.
  for (HostFileState& s : o.files) img->files.push_back(std::move(s.owned));
  auto map = make_map(path, std::move(o.extents), std::move(o.files));
  if (place) img->writer = std::make_unique<VmdkWriter>(path, *map, grain, *place);
  img->map = std::move(map);
  co_return std::make_unique<ExtentDriver>(std::move(*img));
}

}  // namespace qcowfs::image
