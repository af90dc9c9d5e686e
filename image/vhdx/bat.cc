#include "image/vhdx/bat.h"

#include <endian.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>

#include "image/endian.h"
#include "io/buffer.h"
#include "io/log.h"

namespace qcowfs::image::vhdx {
namespace {

constexpr size_t kSlice = 4096;
constexpr size_t kEntriesPerSlice = kSlice / kBatEntrySize;
constexpr uint64_t kCheckChunk = 1 * kMiB;  // BAT bytes read at once by check_bat

uint64_t state_of(uint64_t entry) { return entry & kBatStateMask; }
uint64_t offset_of(uint64_t entry) { return entry & kBatOffsetMask; }

// One FULLY_PRESENT entry as vhdx_check_bat_entries sees it; `payload` says
// whether QEMU's running count takes it for a payload block.
Status check_present(uint64_t i, uint64_t entry, bool payload, const Geometry& g, const Regions& r, uint64_t file_size,
                     const std::string& path) {
  const uint64_t off = offset_of(entry);
  // QEMU's block length uses the BAT index (bitmap entries included) and
  // unsigned arithmetic: a wrapped difference means a whole block.
  const uint64_t left = g.size - i * g.block_size;
  const uint64_t block_length = std::min<uint64_t>(g.block_size, left);
  if (off > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) - g.block_size)
    return Status::errorf(EINVAL, "{}: VHDX BAT entry {} offset {:#x} overflows", path, i, off);
  if (off >= file_size)
    return Status::errorf(EINVAL, "{}: VHDX BAT entry {} offset {:#x} is beyond the end of the file ({} bytes)", path,
                          i, off, file_size);
  if (off + block_length > file_size)
    return Status::errorf(EINVAL, "{}: VHDX BAT entry {} block ends at {:#x}, beyond the end of the file ({} bytes)",
                          path, i, off + block_length, file_size);
  if (payload && overlaps_any(r.used, off, g.block_size))
    return Status::errorf(EINVAL, "{}: VHDX BAT entry {} block at {:#x} overlaps the log or a region", path, i, off);
  return Status::ok();
}

}  // namespace

Task<Status> check_bat(io::HostFile& file, const Geometry& g, const Regions& r, const std::string& path) {
  const uint64_t file_size = file.size();
  co_return co_await for_each_present(file, g, r, path, [&](uint64_t i, uint64_t entry, bool payload) {
    return check_present(i, entry, payload, g, r, file_size, path);
  });
}

Task<Status> for_each_present(io::HostFile& file, const Geometry& g, const Regions& r, const std::string& path,
                              const std::function<Status(uint64_t i, uint64_t entry, bool payload)>& fn) {
  const uint64_t file_size = file.size();
  const uint64_t bytes = uint64_t{g.bat_entries} * kBatEntrySize;
  io::AlignedBuffer buf(kCheckChunk, file.mem_align(), true);
  uint64_t payload_left = g.chunk_ratio;  // QEMU's `payblocks`
  for (uint64_t done = 0; done < bytes; done += kCheckChunk) {
    const uint64_t host = r.bat.offset + done;
    if (host >= file_size) break;  // zeros from here on: NOT_PRESENT
    const auto n = static_cast<size_t>(std::min({kCheckChunk, bytes - done, file_size - host}));
    auto got = co_await file.read(host, buf.span().first(n));
    if (!got) co_return got.status().with_context(fmt::format("{}: reading the VHDX BAT", path));
    for (size_t at = 0; at + kBatEntrySize <= *got; at += kBatEntrySize) {
      const uint64_t entry = load_le64(buf.data() + at);
      if (state_of(entry) != kFullyPresent) continue;
      const bool payload = payload_left != 0;
      payload_left = payload ? payload_left - 1 : g.chunk_ratio;
      QCOWFS_CO_TRY(fn((done + at) / kBatEntrySize, entry, payload));
    }
  }
  co_return Status::ok();
}

namespace {

struct Used {
  uint64_t start = 0;
  uint64_t length = 0;
};


// One entry of a writable image's BAT: the block it uses, if any.
Status note_entry(uint64_t i, uint64_t entry, const Geometry& g, const Regions& r, const std::string& path,
                  std::vector<Used>& used) {
  const bool bitmap = (i + 1) % (g.chunk_ratio + 1) == 0;
  const uint64_t state = state_of(entry);
  if (state == kPartiallyPresent || state == 4)
    return refuse_writable(path, fmt::format("BAT entry {} has state {}", i, state));
  if (state != kFullyPresent) return Status::ok();
  const uint64_t off = offset_of(entry);
  const uint64_t len = bitmap ? kMiB : g.block_size;
  if (off < kHeaderSectionSize)
    return refuse_writable(path, fmt::format("BAT entry {} names offset {:#x}, inside the first MiB", i, off));
  if (overlaps_any(r.used, off, len))
    return refuse_writable(path, fmt::format("BAT entry {} block at {:#x} overlaps the log or a region", i, off));
  used.push_back(Used{off, len});
  return Status::ok();
}

}  // namespace

Task<Result<uint64_t>> check_bat_writable(io::HostFile& file, const Geometry& g, const Regions& r,
                                          const std::string& path) {
  const uint64_t file_size = file.size();
  const uint64_t bytes = uint64_t{g.bat_entries} * kBatEntrySize;
  if (r.bat.offset % kSlice != 0)
    co_return refuse_writable(path, fmt::format("the BAT at {:#x} is not 4 KiB-aligned", r.bat.offset));
  if (r.bat.offset + (bytes + kSlice - 1) / kSlice * kSlice > file_size)
    co_return refuse_writable(path, "the BAT runs past the end of the file");
  std::vector<Used> used;
  io::AlignedBuffer buf(kCheckChunk, file.mem_align(), true);
  for (uint64_t done = 0; done < bytes; done += kCheckChunk) {
    const auto n = static_cast<size_t>(std::min(kCheckChunk, bytes - done));
    auto got = co_await file.read(r.bat.offset + done, buf.span().first(n));
    if (!got) co_return got.status().with_context(fmt::format("{}: reading the VHDX BAT", path));
    for (size_t at = 0; at + kBatEntrySize <= *got; at += kBatEntrySize)
      QCOWFS_CO_TRY(note_entry((done + at) / kBatEntrySize, load_le64(buf.data() + at), g, r, path, used));
  }
  std::sort(used.begin(), used.end(), [](const Used& a, const Used& b) { return a.start < b.start; });
  // New blocks go past the end of the file, of every block and of every
  // region and the log (a region may lie past the end of the file).
  uint64_t end = (file_size + kMiB - 1) / kMiB * kMiB;
  for (const FileRange& used_range : r.used) {
    if (used_range.end <= used_range.start) continue;
    if (used_range.end > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      co_return refuse_writable(path, fmt::format("a region ends at {:#x}, out of range", used_range.end));
    end = std::max(end, (used_range.end + kMiB - 1) / kMiB * kMiB);
  }
  for (size_t i = 0; i < used.size(); ++i) {
    if (i > 0 && used[i].start < used[i - 1].start + used[i - 1].length)
      co_return refuse_writable(path, fmt::format("two BAT entries name overlapping blocks at {:#x} and {:#x}",
                                                  used[i - 1].start, used[i].start));
    end = std::max(end, (used[i].start + used[i].length + kMiB - 1) / kMiB * kMiB);
  }
  co_return end;
}

BatMap::BatMap(io::HostFile& file, const Geometry& g, uint64_t bat_offset, std::string path, uint64_t cache_bytes)
    : file_(file),
      g_(g),
      bat_offset_(bat_offset),
      path_(std::move(path)),
      file_size_(file.size()),
      cache_(
          file, kSlice,
          cache_bytes != 0 ? cache_bytes : TableCache::default_size(uint64_t{g.bat_entries} * kBatEntrySize, kSlice)) {}

Task<Status> BatMap::init() {
  const uint64_t last = g_.bat_entries == 0 ? 0 : g_.bat_entries - 1;
  for (uint64_t index = 0; index <= last; index += kEntriesPerSlice) {
    if (where(index) != Where::tail) continue;
    const uint64_t host = slice_host(index);
    tail_.assign(kSlice, std::byte{0});
    auto got = co_await file_.read(host, std::span(tail_).first(static_cast<size_t>(file_size_ - host)));
    if (!got) co_return got.status().with_context(fmt::format("{}: reading the VHDX BAT", path_));
    break;
  }
  co_return Status::ok();
}

size_t BatMap::offset_in_slice(uint64_t index) { return index % kEntriesPerSlice * kBatEntrySize; }

uint64_t BatMap::load_entry(const TableCache::Ref& slice, size_t at) {
  auto* p = reinterpret_cast<uint64_t*>(const_cast<std::byte*>(slice.bytes().data() + at));  // NOLINT: 8-aligned
  return le64toh(std::atomic_ref<uint64_t>(*p).load(std::memory_order_acquire));
}

void BatMap::store_entry(TableCache::Ref& slice, size_t at, uint64_t entry) {
  auto* p = reinterpret_cast<uint64_t*>(slice.mutable_bytes().data() + at);  // NOLINT: 8-aligned
  std::atomic_ref<uint64_t>(*p).store(htole64(entry), std::memory_order_release);
}

uint64_t BatMap::slice_host(uint64_t index) const { return bat_offset_ + index / kEntriesPerSlice * kSlice; }

BatMap::Where BatMap::where(uint64_t index) const {
  const uint64_t host = slice_host(index);
  if (host >= file_size_) return Where::past_eof;
  return file_size_ - host >= kSlice ? Where::cache : Where::tail;
}

std::optional<uint64_t> BatMap::entry_in_memory(uint64_t index) {
  const size_t at = index % kEntriesPerSlice * kBatEntrySize;
  switch (where(index)) {
    case Where::past_eof:
      return uint64_t{0};
    case Where::tail:
      return load_le64(tail_.data() + at);
    case Where::cache:
      break;
  }
  auto ref = cache_.try_get(slice_host(index));
  if (!ref) return std::nullopt;
  return load_entry(*ref, at);
}

Result<Extent> BatMap::classify(uint64_t entry, uint64_t guest, uint64_t len) const {
  const uint64_t in_block = guest % g_.block_size;
  Extent e;
  e.length = std::min(len, g_.block_size - in_block);
  switch (state_of(entry)) {
    case kNotPresent:
    case kUndefined:
    case kZero:
    case kUnmapped:
    case kUnmappedV095:
      e.kind = ExtentKind::zero;
      return e;
    case kFullyPresent:
      if (offset_of(entry) < kHeaderSectionSize) break;
      e.kind = ExtentKind::data;
      e.file = &file_;
      e.host_offset = offset_of(entry) + in_block;
      e.show_offset = false;
      return e;
    default:
      break;
  }
  log::error("{}: corrupt VHDX BAT entry {:#x} (state {}) for guest offset {:#x}", path_, entry, state_of(entry),
             guest);
  return Status::errorf(EIO, "{}: invalid VHDX BAT entry {:#x} for guest offset {:#x}", path_, entry, guest);
}

// Grows `first` over the following blocks whose entries are in memory and
// continue it (zeros after zeros, data contiguous in the file).
Result<Extent> BatMap::extend(Extent first, uint64_t guest, uint64_t len) {
  while (first.length < len) {
    const uint64_t next = guest + first.length;
    auto entry = entry_in_memory(g_.bat_index(next));
    if (!entry) break;
    auto e = classify(*entry, next, len - first.length);
    if (!e || e->kind != first.kind) break;
    if (e->kind == ExtentKind::data && e->host_offset != first.host_offset + first.length) break;
    first.length += e->length;
  }
  return first;
}

Result<std::optional<Extent>> BatMap::try_map(uint64_t guest, uint64_t len) {
  auto entry = entry_in_memory(g_.bat_index(guest));
  if (!entry) return std::optional<Extent>{};
  auto e = classify(*entry, guest, len);
  if (!e) return e.status();
  auto grown = extend(*e, guest, len);
  if (!grown) return grown.status();
  return std::optional<Extent>{*grown};
}

Task<Result<Extent>> BatMap::map(uint64_t guest, uint64_t len) {
  const uint64_t index = g_.bat_index(guest);
  if (where(index) == Where::cache) {
    auto ref = co_await cache_.get(slice_host(index));
    if (!ref) co_return ref.status().with_context(fmt::format("{}: reading the VHDX BAT", path_));
  }
  auto e = try_map(guest, len);
  if (!e) co_return e.status();
  if (*e) co_return **e;
  // Evicted again before we looked: map this block alone from a fresh load.
  auto ref = co_await cache_.get(slice_host(index));
  if (!ref) co_return ref.status();
  co_return classify(load_entry(*ref, offset_in_slice(index)), guest, len);
}

}  // namespace qcowfs::image::vhdx
