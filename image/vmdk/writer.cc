#include "image/vmdk/writer.h"

#include <algorithm>
#include <random>
#include <set>

#include "image/endian.h"
#include "image/extent/host_read.h"
#include "image/vmdk/descriptor.h"
#include "image/vmdk/format.h"
#include "io/align.h"

namespace qcowfs::image::vmdk {
namespace {

// Grain sectors are 32-bit in a grain table (QEMU's VMDK_EXTENT_MAX_SECTORS).
constexpr uint64_t kMaxGrainHostEnd = (1ull << 32) * kSector;
// Copy-on-write of a grain is buffered whole: grains above this stay read-only.
constexpr uint64_t kMaxWritableGrain = 64ull << 20;

Status refuse(const std::string& path, std::string_view why) {
  return Status::errorf(EROFS, "{}: {}; this VMDK image cannot be written: mount it read-only", path, why);
}

struct Interval {
  uint64_t start = 0, end = 0;
  std::string what;
};

// The metadata of a sparse extent that must not overlap: header, embedded
// descriptor, both grain directories and every grain table.
Result<std::vector<Interval>> metadata_of(const std::string& path, const VExtent& x) {
  std::vector<Interval> v;
  v.push_back({0, kSector, "the header"});
  if (x.desc_size > 0) v.push_back({x.desc_offset, x.desc_offset + x.desc_size, "the embedded descriptor"});
  const uint64_t gt_bytes = uint64_t{x.gtes} * 4;
  auto add_dir = [&](const std::vector<uint32_t>& dir, uint64_t offset, const char* name) -> Status {
    if (dir.size() < x.gd_size) return refuse(path, fmt::format("the {} runs past the end of the file", name));
    v.push_back({offset, offset + uint64_t{x.gd_size} * 4, fmt::format("the {}", name)});
    for (uint32_t i = 0; i < x.gd_size; ++i) {
      if (dir[i] == 0)
        return refuse(path, fmt::format("{} entry {} names no grain table (qcowfs, like QEMU, writes only images "
                                        "whose grain tables are all allocated)",
                                        name, i));
      const uint64_t at = uint64_t{dir[i]} * kSector;
      v.push_back({at, at + gt_bytes, fmt::format("grain table {} of the {}", i, name)});
    }
    return Status::ok();
  };
  QCOWFS_TRY(add_dir(x.gd, x.gd_offset, "grain directory"));
  if (x.rgd_offset != 0) QCOWFS_TRY(add_dir(x.rgd, x.rgd_offset, "redundant grain directory"));
  return v;
}

Status check_metadata_layout(const std::string& path, const VExtent& x, std::vector<Interval> v) {
  for (const Interval& i : v) {
    if (i.end > x.grain_offset)
      return refuse(path,
                    fmt::format("{} ends at {:#x}, past the grain area's start {:#x}", i.what, i.end, x.grain_offset));
    // Grain tables are changed in whole cached windows of the file.
    if (align_up(i.end, uint64_t{kGtWindow}) > x.file->size())
      return refuse(path, fmt::format("{} ends at {:#x}, too close to the end of the file", i.what, i.end));
  }
  std::sort(v.begin(), v.end(), [](const Interval& a, const Interval& b) { return a.start < b.start; });
  for (size_t k = 1; k < v.size(); ++k)
    if (v[k].start < v[k - 1].end) return refuse(path, fmt::format("{} overlaps {}", v[k].what, v[k - 1].what));
  return Status::ok();
}

// Every grain the tables name lies in the grain area, inside the file's
// grains, and no two overlap: a new grain then never lands on one in use.
Task<Status> check_grains(const std::string& path, const VExtent& x) {
  io::HostFile& f = *x.file;
  const uint64_t next = align_up(f.size(), x.grain_bytes);
  const uint64_t most = (next - std::min(next, x.grain_offset)) / x.grain_bytes;
  std::vector<uint32_t> table(x.gtes);
  std::vector<uint32_t> grains;
  for (uint32_t i = 0; i < x.gd_size; ++i) {
    std::span<std::byte> bytes(reinterpret_cast<std::byte*>(table.data()), table.size() * 4);
    QCOWFS_CO_TRY(co_await read_padded(f, uint64_t{x.gd[i]} * kSector, bytes));
    for (uint32_t k = 0; k < x.gtes; ++k) {
      const uint32_t gte = le32toh(table[k]);
      if (gte == 0 || (x.zero_grain && gte == kGteZeroed)) continue;
      const uint64_t at = uint64_t{gte} * kSector;
      if (at < x.grain_offset || at + x.grain_bytes > next)
        co_return refuse(path, fmt::format("grain table {} entry {} names host offset {:#x}, outside the grains "
                                           "[{:#x}, {:#x})",
                                           i, k, at, x.grain_offset, next));
      if (grains.size() >= most) co_return refuse(path, "grain tables name more grains than the file holds");
      grains.push_back(gte);
    }
  }
  std::sort(grains.begin(), grains.end());
  for (size_t k = 1; k < grains.size(); ++k)
    if (uint64_t{grains[k] - grains[k - 1]} * kSector < x.grain_bytes)
      co_return refuse(path, fmt::format("grains at host offsets {:#x} and {:#x} overlap",
                                         uint64_t{grains[k - 1]} * kSector, uint64_t{grains[k]} * kSector));
  co_return Status::ok();
}

}  // namespace

Task<Result<uint64_t>> check_writable(const std::string& path, const std::vector<VExtent>& extents) {
  uint64_t grain = 0;
  std::set<io::HostFile*> sparse_files, flat_files;
  for (const VExtent& x : extents) {
    if (x.flat) {
      flat_files.insert(x.file);
      continue;
    }
    if (x.compressed)
      co_return refuse(path,
                       "streamOptimized extents are read-only (QEMU only appends to them; qemu-img convert "
                       "-O vmdk makes a writable copy)");
    if (x.vmdk3) co_return refuse(path, fmt::format("extent '{}' is VMFS sparse (COWD)", x.filename));
    if (grain == 0) grain = x.grain_bytes;
    if (x.grain_bytes != grain)
      co_return refuse(path,
                       fmt::format("extent '{}' has {}-byte grains, another {}", x.filename, x.grain_bytes, grain));
    if (grain > kMaxWritableGrain)
      co_return refuse(path,
                       fmt::format("grains of {} bytes are larger than qcowfs writes ({})", grain, kMaxWritableGrain));
    if (x.start % grain != 0)
      co_return refuse(
          path, fmt::format("extent '{}' starts at guest byte {:#x}, not at a whole grain", x.filename, x.start));
    if (!sparse_files.insert(x.file).second)
      co_return refuse(path, fmt::format("extent file '{}' holds two sparse extents", x.filename));
    auto meta = metadata_of(path, x);
    if (!meta) co_return meta.status();
    QCOWFS_CO_TRY(check_metadata_layout(path, x, std::move(*meta)));
    QCOWFS_CO_TRY(co_await check_grains(path, x));
  }
  for (io::HostFile* f : flat_files)
    if (sparse_files.count(f)) co_return refuse(path, fmt::format("'{}' holds a flat and a sparse extent", f->path()));
  co_return grain;
}

VmdkWriter::VmdkWriter(std::string path, VmdkMap& map, uint64_t grain, DescriptorPlace desc)
    : path_(std::move(path)), map_(map), grain_(grain == 0 ? kSector : grain), desc_(desc) {
  for (const VExtent& x : map_.extents()) {
    if (x.flat) continue;
    tails_[x.file] = FileTail{align_up(x.file->size(), grain_), x.file->size()};
  }
}

// QEMU's vmdk_write_cid(): the descriptor with a new random CID, flushed.
// An embedded descriptor keeps its size (the text's NULs absorb a longer CID).
Task<Status> VmdkWriter::before_first_write() {
  io::HostFile& f = *desc_.file;
  const uint64_t n = desc_.whole_file ? f.size() : desc_.size;
  std::vector<std::byte> old(static_cast<size_t>(n));
  QCOWFS_CO_TRY(co_await read_padded(f, desc_.offset, old));
  const std::string_view text(reinterpret_cast<const char*>(old.data()), old.size());
  const uint32_t cid = std::random_device{}();
  auto edited = descriptor_with_cid(text, cid);
  if (!edited) co_return edited.status().with_context(fmt::format("{}: updating the CID", path_));
  const size_t old_len = c_string(text.substr(0, std::min(text.size(), kDescWindow - 1))).size();
  std::string out = *edited + std::string(text.substr(old_len));
  if (!desc_.whole_file) {
    if (out.find_first_not_of('\0', static_cast<size_t>(n)) != std::string::npos)
      co_return Status::errorf(EIO, "{}: no room for a new CID in the embedded descriptor", path_);
    out.resize(static_cast<size_t>(n));
  }
  std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(out.data()), out.size());
  QCOWFS_CO_TRY(co_await f.write(desc_.offset, bytes));
  if (desc_.whole_file && out.size() < n) QCOWFS_CO_TRY(co_await f.truncate(out.size()));
  co_return co_await f.flush();
}

uint64_t VmdkWriter::run_limit(uint64_t first) const {
  const VExtent& x = map_.find(first * grain_);
  return (x.start + x.size + grain_ - 1) / grain_ - first;
}

// The grain-table entries of a unit: its grain table's, and the redundant
// grain table's when the extent has one.
Result<std::vector<VmdkWriter::EntryAt>> VmdkWriter::entries_of(uint64_t unit) const {
  const uint64_t guest = unit * grain_;
  const VExtent& x = map_.find(guest);
  const uint64_t rel = guest - x.start;
  auto at = map_.entry_offset(x, rel, guest);
  if (!at) return at.status();
  if (*at == VmdkMap::kNoSlice) return Status::errorf(EIO, "{}: guest offset {:#x} has no grain table", path_, guest);
  std::vector<EntryAt> out;
  auto add = [&](uint64_t host) {
    const uint64_t window = host / kGtWindow * kGtWindow;
    out.push_back(EntryAt{x.cache, window, static_cast<size_t>(host - window)});
  };
  add(*at);
  if (x.rgd_offset != 0) {
    const uint64_t index = rel / x.gd_coverage;
    add(uint64_t{x.rgd[index]} * kSector + (rel / x.grain_bytes) % x.gtes * 4);
  }
  return out;
}

// The grain-table windows of the units, loaded and pinned until publish() (a
// failed request's pins go at the next write_metadata()).
Task<Status> VmdkWriter::prepare(uint64_t first, uint64_t n) {
  for (uint64_t u = first; u < first + n; ++u) {
    auto entries = entries_of(u);
    if (!entries) co_return entries.status();
    for (const EntryAt& e : *entries)
      QCOWFS_CO_TRY(co_await slices_.pin(*e.cache, e.window, path_ + ": a VMDK grain table"));
  }
  co_return Status::ok();
}

Task<Result<HostRun>> VmdkWriter::reserve(uint64_t first, uint64_t n) {
  const VExtent& x = map_.find(first * grain_);
  FileTail& t = tails_[x.file];
  const uint64_t end = t.next + n * grain_;
  if (end > kMaxGrainHostEnd)
    co_return Status::errorf(ENOSPC, "VMDK extent '{}' is full (grains must start below 2 TiB in their file)",
                             x.filename);
  if (x.file->is_block_device() && end > x.file->size())
    co_return Status::errorf(ENOSPC, "VMDK extent '{}': its block device is full ({} bytes)", x.filename,
                             x.file->size());
  co_return t.take(*x.file, n, grain_);
}

void VmdkWriter::unreserve(const HostRun& run) { tails_[run.file].give_back(run, grain_); }

void VmdkWriter::publish(uint64_t first, const HostRun& run) {
  for (uint64_t i = 0; i < run.units; ++i) store(first + i, static_cast<uint32_t>((run.host + i * grain_) / kSector));
}

bool VmdkWriter::has_zero_state(uint64_t unit) const {
  const VExtent& x = map_.find(unit * grain_);
  return !x.flat && x.zero_grain;
}

void VmdkWriter::mark_zero(uint64_t first, uint64_t n) {
  for (uint64_t u = first; u < first + n; ++u) store(u, kGteZeroed);
}

// The unit's grain-table entries (prepare()d) become gte.
void VmdkWriter::store(uint64_t unit, uint32_t gte) {
  auto entries = entries_of(unit);  // prepare() resolved them: cannot fail now
  if (!entries) return;
  for (const EntryAt& e : *entries) VmdkMap::store_gte(slices_.change(*e.cache, e.window), e.at, gte);
}

// A grain written in part ends its file early: the file covers whole grains
// before a table names them (qemu-img check wants no grain past the end).
Task<Status> VmdkWriter::cover_grains() {
  for (const auto& [file, t] : tails_)
    if (!file->is_block_device() && file->size() < t.next) QCOWFS_CO_TRY(co_await file->truncate(t.next));
  co_return Status::ok();
}

Task<Status> VmdkWriter::write_metadata() {
  slices_.release_pins();  // no allocation is in flight (ExtentDriver::quiesce)
  if (!slices_.dirty()) co_return Status::ok();
  QCOWFS_CO_TRY(co_await cover_grains());
  co_return co_await slices_.write_dirty();
}

}  // namespace qcowfs::image::vmdk
