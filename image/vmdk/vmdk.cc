// VMDK opening (QEMU 7.2 block/vmdk.c: vmdk_open, vmdk_open_vmdk4,
// vmdk_open_vmfs_sparse, vmdk_parse_extents) and the guest-to-host map
// (get_cluster_offset, vmdk_co_block_status, vmdk_read_extent).
#include "image/vmdk/vmdk.h"

#include <limits.h>
#include <stdlib.h>
#include <zlib.h>

#include <algorithm>
#include <cstring>
#include <map>

#include "image/backing.h"
#include "image/endian.h"
#include "image/extent_driver.h"
#include "image/path.h"
#include "image/table_cache.h"
#include "image/vmdk/descriptor.h"
#include "image/vmdk/format.h"

namespace qcowfs::image {
namespace {

using namespace vmdk;

constexpr size_t kSlice = TableCache::kDefaultSliceSize;
constexpr uint64_t kMaxSectors = static_cast<uint64_t>(INT64_MAX) / kSector;

// One extent: a consecutive guest range in one host file.
struct VExtent {
  uint64_t start = 0;  // guest bytes
  uint64_t size = 0;   // guest bytes
  io::HostFile* file = nullptr;
  bool flat = false;
  uint64_t flat_offset = 0;  // bytes
  // Sparse extents:
  bool compressed = false, markers = false, zero_grain = false;
  uint64_t grain_bytes = 0;
  uint32_t gtes = 0;         // entries per grain table
  uint64_t gd_coverage = 0;  // bytes one GD entry maps (QEMU's l1_entry_sectors)
  uint32_t gd_size = 0;      // GD entries (QEMU's l1_size)
  std::vector<uint32_t> gd;  // the entries inside the file; the rest read as 0
  TableCache* cache = nullptr;
  // For info:
  std::string type, filename;
};

// What every extent of one host file shares.
struct HostFileState {
  std::unique_ptr<io::HostFile> owned;
  io::HostFile* file = nullptr;
  std::unique_ptr<TableCache> cache;  // grain tables, in kSlice windows of the file
  uint64_t tail_slice = 0;            // the window that crosses the end of the file
  std::vector<std::byte> tail_bytes;  // its bytes, zero-padded (empty: none)
};

Task<Result<std::vector<std::byte>>> read_padded(io::HostFile& f, uint64_t off, size_t n) {
  std::vector<std::byte> b(n);
  if (off >= f.size()) co_return b;
  size_t want = static_cast<size_t>(std::min<uint64_t>(n, f.size() - off));
  auto r = co_await f.read(off, std::span(b).first(want));
  if (!r) co_return r.status().with_context(fmt::format("reading {}", f.path()));
  co_return b;
}

class VmdkMap final : public ExtentMap {
 public:
  VmdkMap(std::string path, std::vector<VExtent> extents, std::vector<HostFileState> files)
      : path_(std::move(path)), extents_(std::move(extents)), files_(std::move(files)) {}

  Result<std::optional<Extent>> try_map(uint64_t guest, uint64_t len) override {
    const VExtent& x = find(guest);
    uint64_t rel = guest - x.start;
    len = std::min(len, x.size - rel);
    if (x.flat) {
      Extent e;
      e.kind = ExtentKind::data;
      e.length = len;
      e.file = x.file;
      e.host_offset = x.flat_offset + rel;
      e.host_holes_are_zero = true;
      return std::optional<Extent>(e);
    }
    return map_sparse(x, guest, rel, len, nullptr);
  }

  Task<Result<Extent>> map(uint64_t guest, uint64_t len) override {
    const VExtent& x = find(guest);
    uint64_t rel = guest - x.start;
    TableCache::Ref ref;
    if (!x.flat) {
      auto slice = slice_of(x, rel);
      if (!slice) co_return slice.status();
      if (*slice != kNoSlice) {
        auto r = co_await x.cache->get(*slice);
        if (!r) co_return r.status().with_context(fmt::format("{}: guest offset {:#x}", path_, guest));
        ref = std::move(*r);
      }
    }
    auto e = ref ? map_sparse(x, guest, rel, std::min(len, x.size - rel), &ref) : try_map(guest, len);
    if (!e) co_return e.status();
    if (!*e) co_return Status::errorf(EIO, "{}: no mapping for guest offset {:#x}", path_, guest);
    co_return **e;
  }

  Status decompress(const Extent& e, std::span<const std::byte> stream, std::span<std::byte> out) const override {
    const VExtent& x = find_by_file(e);
    std::span<const std::byte> data = stream;
    uint64_t data_len = x.grain_bytes;
    if (x.markers) {
      data_len = load_le32(stream.data() + kMarkerSize);
      data = stream.subspan(kGrainMarkerHeader);
    }
    if (data_len == 0 || data_len > stream.size())
      return Status::errorf(EIO, "{}: compressed grain at {:#x} has a bad size {}", path_, e.host_offset, data_len);
    data_len = std::min<uint64_t>(data_len, data.size());
    std::vector<std::byte> tmp;
    std::byte* dst = out.data();
    if (out.size() < x.grain_bytes) {
      tmp.resize(x.grain_bytes);
      dst = tmp.data();
    }
    uLongf got = static_cast<uLongf>(x.grain_bytes);
    int z = ::uncompress(reinterpret_cast<Bytef*>(dst), &got, reinterpret_cast<const Bytef*>(data.data()),
                         static_cast<uLong>(data_len));
    if (z != Z_OK)
      return Status::errorf(EIO, "{}: compressed grain at {:#x} does not inflate (zlib {})", path_, e.host_offset, z);
    if (got < out.size())
      return Status::errorf(EIO, "{}: compressed grain at {:#x} inflates to {} bytes, fewer than {}", path_,
                            e.host_offset, got, out.size());
    if (!tmp.empty()) std::memcpy(out.data(), tmp.data(), out.size());
    return Status::ok();
  }

 private:
  static constexpr uint64_t kNoSlice = ~0ull;

  const VExtent& find(uint64_t guest) const {
    auto it = std::upper_bound(extents_.begin(), extents_.end(), guest,
                               [](uint64_t g, const VExtent& x) { return g < x.start; });
    return *(it - 1);
  }
  const VExtent& find_by_file(const Extent& e) const {
    for (const VExtent& x : extents_)
      if (x.file == e.file && x.compressed) return x;
    return extents_.front();
  }
  const HostFileState& state_of(const VExtent& x) const {
    for (const HostFileState& s : files_)
      if (s.file == x.file) return s;
    return files_.front();
  }

  // The GD entry for rel: the grain table's sector, 0 for none.
  Result<uint32_t> gd_entry(const VExtent& x, uint64_t rel, uint64_t guest) const {
    uint64_t index = rel / x.gd_coverage;
    if (index >= x.gd_size)
      return Status::errorf(EIO, "{}: guest offset {:#x} is past the grain directory ({} entries)", path_, guest,
                            x.gd_size);
    return index < x.gd.size() ? x.gd[index] : 0u;
  }

  // Host byte offset of rel's grain-table entry (kNoSlice: no grain table).
  Result<uint64_t> entry_offset(const VExtent& x, uint64_t rel, uint64_t guest) const {
    auto gt = gd_entry(x, rel, guest);
    if (!gt) return gt.status();
    if (*gt == 0) return kNoSlice;
    uint64_t index = (rel / x.grain_bytes) % x.gtes;
    return uint64_t{*gt} * kSector + index * 4;
  }

  // The cached window holding rel's grain-table entry; kNoSlice when it needs none.
  Result<uint64_t> slice_of(const VExtent& x, uint64_t rel) const {
    auto at = entry_offset(x, rel, x.start + rel);
    if (!at) return at.status();
    if (*at == kNoSlice) return kNoSlice;
    uint64_t slice = *at / kSlice * kSlice;
    if (slice + kSlice > x.file->size()) return kNoSlice;  // tail window or past the end: in memory
    return slice;
  }

  // Reads the entry at host byte `at` from `ref` (that window) or from memory;
  // nullopt when the window is not cached.
  std::optional<uint32_t> entry(const VExtent& x, uint64_t at, TableCache::Ref* ref) const {
    uint64_t slice = at / kSlice * kSlice;
    const HostFileState& s = state_of(x);
    if (slice + kSlice > x.file->size()) {
      if (!s.tail_bytes.empty() && slice == s.tail_slice) return load_le32(s.tail_bytes.data() + (at - slice));
      return 0u;  // past the end of the file: QEMU reads zeros
    }
    if (ref && *ref && ref->host_offset() == slice) return ref->le32(static_cast<size_t>(at - slice));
    auto r = x.cache->try_get(slice);
    if (!r) return std::nullopt;
    return r->le32(static_cast<size_t>(at - slice));
  }

  Extent grain_extent(const VExtent& x, uint64_t rel, uint64_t len, uint32_t gte) const {
    uint64_t in_grain = rel % x.grain_bytes;
    Extent e;
    e.length = std::min(len, x.grain_bytes - in_grain);
    if (gte == 0) {
      e.kind = ExtentKind::unallocated;
    } else if (x.zero_grain && gte == kGteZeroed) {
      e.kind = ExtentKind::zero;
    } else if (x.compressed) {
      e.kind = ExtentKind::compressed;
      e.file = x.file;
      e.host_offset = uint64_t{gte} * kSector;
      e.unit_offset = in_grain;
      e.unit_size = std::min(x.grain_bytes, x.size - (rel - in_grain));
      e.stored_size = 2 * x.grain_bytes;
    } else {
      e.kind = ExtentKind::data;
      e.file = x.file;
      e.host_offset = uint64_t{gte} * kSector + in_grain;
    }
    return e;
  }

  static bool extends(const Extent& a, const Extent& b) {
    if (a.kind != b.kind || a.kind == ExtentKind::compressed) return false;
    return a.kind != ExtentKind::data || a.host_offset + a.length == b.host_offset;
  }

  Result<std::optional<Extent>> map_sparse(const VExtent& x, uint64_t guest, uint64_t rel, uint64_t len,
                                           TableCache::Ref* ref) const {
    auto at = entry_offset(x, rel, guest);
    if (!at) return at.status();
    if (*at == kNoSlice) {  // no grain table: unallocated to the end of the GD entry
      Extent e;
      e.length = std::min(len, x.gd_coverage - rel % x.gd_coverage);
      return std::optional<Extent>(e);
    }
    auto gte = entry(x, *at, ref);
    if (!gte) return std::optional<Extent>();
    Extent e = grain_extent(x, rel, len, *gte);
    // Following grains of the same grain table and window, while they continue e.
    uint64_t slice = *at / kSlice;
    while (e.length < len && (rel + e.length) % x.gd_coverage != 0) {
      uint64_t next_at = *at + ((rel + e.length) / x.grain_bytes - rel / x.grain_bytes) * 4;
      if (next_at / kSlice != slice) break;
      auto g = entry(x, next_at, ref);
      if (!g) break;
      Extent n = grain_extent(x, rel + e.length, len - e.length, *g);
      if (!extends(e, n)) break;
      e.length += n.length;
    }
    return std::optional<Extent>(e);
  }

  std::string path_;
  std::vector<VExtent> extents_;
  std::vector<HostFileState> files_;
};

// ---- Opening ----

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
  std::string create_type;
  bool have_create_type = false;
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
  auto b = co_await read_padded(f, rounded - kFooterBytes, kFooterBytes);
  if (!b) co_return b.status();
  const std::byte* p = b->data();
  const std::byte* eos = p + 2 * kSector;
  if (load_be32(p + kSector) != kVmdk4MagicBe || load_le32(p + kMarkerSize) != 0 ||
      load_le32(p + kMarkerType) != kMarkerFooter || load_le64(eos + kMarkerValue) != 0 ||
      load_le32(eos + kMarkerSize) != 0 || load_le32(eos + kMarkerType) != kMarkerEndOfStream)
    co_return Status::errorf(EINVAL, "{}: invalid stream footer", name);
  co_return parse_sparse_header(std::span(*b).subspan(kSector, kSector));
}

Status check_sparse(const SparseHeader& h, uint64_t file_size, const std::string& name) {
  if (!h.vmdk3) {
    if (h.version > kMaxVersion) return Status::errorf(ENOTSUP, "{}: unsupported VMDK version {}", name, h.version);
    if (h.num_gtes_per_gt > kMaxGtesPerGt)
      return Status::errorf(EINVAL, "{}: grain tables of {} entries are too big (at most {})", name,
                            h.num_gtes_per_gt, kMaxGtesPerGt);
    if (static_cast<uint32_t>(h.num_gtes_per_gt * h.granularity) == 0)
      return Status::errorf(EINVAL, "{}: invalid grain directory entry coverage (grain size {}, {} entries)", name,
                            h.granularity, h.num_gtes_per_gt);
    if ((file_size + kSector - 1) / kSector < h.grain_offset)
      return Status::errorf(EINVAL, "{}: file truncated, expecting at least {} bytes", name,
                            h.grain_offset * kSector);
  } else if (h.granularity == 0) {
    return Status::errorf(EINVAL, "{}: grain size 0", name);
  }
  if (h.granularity > kMaxGrainSectors)
    return Status::errorf(EFBIG, "{}: invalid grain size {} sectors, image may be corrupt", name, h.granularity);
  if (h.capacity > kMaxSectors) return Status::errorf(EFBIG, "{}: capacity {} sectors is absurd", name, h.capacity);
  if (h.gd_offset > kMaxSectors) return Status::errorf(EINVAL, "{}: grain directory offset {} is absurd", name, h.gd_offset);
  return Status::ok();
}

Task<Status> load_gd(VExtent& x, uint64_t gd_sector) {
  io::HostFile& f = *x.file;
  uint64_t at = gd_sector * kSector;
  uint64_t inside = at >= f.size() ? 0 : std::min<uint64_t>(x.gd_size, (f.size() - at) / 4);
  if (inside == 0) co_return Status::ok();
  auto b = co_await read_padded(f, at, static_cast<size_t>(inside * 4));
  if (!b) co_return b.status().with_context("reading the grain directory");
  x.gd.resize(inside);
  for (uint64_t i = 0; i < inside; ++i) x.gd[i] = load_le32(b->data() + i * 4);
  co_return Status::ok();
}

Task<Status> prepare_tables(HostFileState& s, uint64_t gt_bytes) {
  if (s.cache) co_return Status::ok();
  io::HostFile& f = *s.file;
  s.cache = std::make_unique<TableCache>(f, kSlice, TableCache::default_size(gt_bytes, kSlice));
  if (f.size() % kSlice != 0) {
    s.tail_slice = f.size() / kSlice * kSlice;
    auto b = co_await read_padded(f, s.tail_slice, kSlice);
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
  auto head = co_await read_padded(f, 0, kSector);
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
    auto text = co_await read_padded(f, h.desc_offset * kSector,
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
  uint64_t coverage_sectors = static_cast<uint32_t>(uint64_t{h.num_gtes_per_gt} * h.granularity);
  x.gd_coverage = coverage_sectors * kSector;
  uint64_t gd_size = h.vmdk3 ? h.gd_entries : static_cast<uint32_t>((h.capacity + coverage_sectors - 1) / coverage_sectors);
  if (gd_size > kMaxGdEntries) co_return Status::errorf(EFBIG, "{}: grain directory of {} entries is too big", filename, gd_size);
  x.gd_size = static_cast<uint32_t>(gd_size);
  if (!h.vmdk3) {
    x.compressed = h.compress_algorithm == kCompressionDeflate;
    x.markers = (h.flags & kFlagMarkers) != 0;
    x.zero_grain = (h.flags & kFlagZeroGrain) != 0;
    if (x.compressed) o.create_type = "streamOptimized";
  }
  QCOWFS_CO_TRY(co_await load_gd(x, h.gd_offset));
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
  io::OpenOptions fo = o.opts.file;
  fo.writable = false;
  auto f = io::open_host_file(resolved, fo);
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

// Reads of a delta whose parentCID is not its parent's CID fail, as QEMU's
// (vmdk_is_cid_valid); everything else goes to the parent.
class CidMismatch final : public BlockDriver {
 public:
  CidMismatch(std::unique_ptr<BlockDriver> inner, std::string msg) : inner_(std::move(inner)), msg_(std::move(msg)) {}
  std::string_view format_name() const override { return inner_->format_name(); }
  uint64_t size() const override { return inner_->size(); }
  bool read_only() const override { return true; }
  size_t mem_align() const override { return inner_->mem_align(); }
  Task<Status> read(uint64_t, std::span<std::byte>) override { co_return Status::error(EINVAL, msg_); }
  Task<Status> write(uint64_t, std::span<const std::byte>) override { co_return Status::error(EROFS, msg_); }
  Task<Status> flush() override { co_return Status::ok(); }
  Task<Status> discard(uint64_t, uint64_t) override { co_return Status::error(EROFS, msg_); }
  Task<Status> write_zeroes(uint64_t, uint64_t, bool) override { co_return Status::error(EROFS, msg_); }
  Task<Status> truncate(uint64_t) override { co_return Status::error(EROFS, msg_); }
  Task<Result<BlockStatus>> block_status(uint64_t off, uint64_t len) override {
    co_return co_await inner_->block_status(off, len);
  }
  uint64_t allocated_bytes() const override { return inner_->allocated_bytes(); }
  Task<Status> close() override { co_return co_await inner_->close(); }
  ImageDetails details() const override { return inner_->details(); }

 private:
  std::unique_ptr<BlockDriver> inner_;
  std::string msg_;
};

std::optional<uint64_t> cid_of(const BlockDriver& d) {
  if (d.format_name() != "vmdk") return std::nullopt;
  const ImageDetails details = d.details();
  for (const auto& [k, v] : details.specific.members())
    if (k == "cid") {
      auto t = v.scalar_text();
      return std::strtoull(t.c_str(), nullptr, 10);
    }
  return std::nullopt;
}

Task<Result<std::unique_ptr<BlockDriver>>> open_parent(const Opening& o, const std::string& hint, uint32_t parent_cid) {
  auto b = co_await open_backing_file(o.path, hint, "vmdk", o.opts);
  if (!b) co_return b.status();
  std::unique_ptr<BlockDriver> parent = std::move(*b);
  auto cid = cid_of(*parent);
  if (cid && *cid != parent_cid) {
    std::string msg = fmt::format("{}: parentCID {:08x} is not the CID {:08x} of its parent {}", o.path, parent_cid,
                                  *cid, hint);
    parent = std::make_unique<CidMismatch>(std::move(parent), std::move(msg));
  }
  co_return parent;
}

Task<Result<std::unique_ptr<BlockDriver>>> open_vmdk_impl(std::unique_ptr<io::HostFile> file, std::string path,
                                                          ImageOptions opts) {
  QCOWFS_CO_TRY(refuse_writable_open("VMDK", path, opts));
  auto chain = enter_backing_chain(path, opts);
  if (!chain) co_return chain.status();
  if (file->size() < 4) co_return Status::errorf(EINVAL, "{}: file is too small to be a VMDK image", path);
  Opening o;
  o.path = path;
  o.opts = opts;
  HostFileState top;
  top.file = file.get();
  top.owned = std::move(file);
  o.files.push_back(std::move(top));
  io::HostFile& f = *o.files[0].file;

  auto head = co_await read_padded(f, 0, 4);
  if (!head) co_return head.status();
  uint32_t magic = load_be32(head->data());
  std::string window;
  if (magic == kVmdk4MagicBe || magic == kVmdk3MagicBe) {
    QCOWFS_CO_TRY(co_await open_sparse(o, 0, "", path, 0));
    auto w = co_await read_padded(f, kDescOffsetInSparse, kDescWindow);
    if (!w) co_return w.status();
    window.assign(reinterpret_cast<const char*>(w->data()), w->size());
  } else {
    auto text = co_await read_padded(f, 0, static_cast<size_t>(std::min<uint64_t>(f.size(), kMaxDescriptorBytes)));
    if (!text) co_return text.status();
    window.assign(reinterpret_cast<const char*>(text->data()), text->size());
    QCOWFS_CO_TRY(co_await open_descriptor(o, window, 0));
  }
  if (o.extents.empty()) co_return Status::errorf(EINVAL, "{}: VMDK image has no extents", path);
  auto hint = descriptor_parent_hint(window);
  if (!hint) co_return hint.status().with_context(path);
  auto cid = descriptor_cid(window, false);
  if (!cid) co_return cid.status().with_context(path);
  auto parent_cid = descriptor_cid(window, true);
  if (!parent_cid) co_return parent_cid.status().with_context(path);

  ExtentImage img;
  img.format = "vmdk";
  img.path = path;
  img.size = o.total;
  img.details = details_of(o, *cid, *parent_cid);
  for (const VExtent& x : o.extents)
    if (x.compressed) img.compressed_unit_size = std::max(img.compressed_unit_size, x.grain_bytes);
  if (*hint) {
    img.details.backing_file = **hint;
    img.details.backing_format = "vmdk";
    if (!opts.no_backing) {
      auto b = co_await open_parent(o, **hint, *parent_cid);
      if (!b) co_return b.status();
      img.backing = std::move(*b);
    }
  }
  // The image owns the files; the map their grain-table caches.
  for (HostFileState& s : o.files) img.files.push_back(std::move(s.owned));
  img.map = std::make_unique<VmdkMap>(path, std::move(o.extents), std::move(o.files));
  co_return std::make_unique<ExtentDriver>(std::move(img));
}

}  // namespace

Task<Result<std::unique_ptr<BlockDriver>>> open_vmdk(std::unique_ptr<io::HostFile> file, std::string path,
                                                     ImageOptions opts) {
  co_return co_await open_vmdk_impl(std::move(file), std::move(path), std::move(opts));
}

}  // namespace qcowfs::image
