#include "image/vhdx/bat.h"

#include <algorithm>
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
Status check_present(uint64_t i, uint64_t entry, bool payload, const Geometry& g, const Regions& r,
                     uint64_t file_size, const std::string& path) {
  const uint64_t off = offset_of(entry);
  // QEMU's block length uses the BAT index (bitmap entries included) and
  // unsigned arithmetic: a wrapped difference means a whole block.
  const uint64_t left = g.size - i * g.block_size;
  const uint64_t block_length = std::min<uint64_t>(g.block_size, left);
  if (off > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) - g.block_size)
    return Status::errorf(EINVAL, "{}: VHDX BAT entry {} offset {:#x} overflows", path, i, off);
  if (off >= file_size)
    return Status::errorf(EINVAL, "{}: VHDX BAT entry {} offset {:#x} is beyond the end of the file ({} bytes)",
                          path, i, off, file_size);
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
      QCOWFS_CO_TRY(check_present((done + at) / kBatEntrySize, entry, payload, g, r, file_size, path));
    }
  }
  co_return Status::ok();
}

BatMap::BatMap(io::HostFile& file, const Geometry& g, uint64_t bat_offset, std::string path, uint64_t cache_bytes)
    : file_(file),
      g_(g),
      bat_offset_(bat_offset),
      path_(std::move(path)),
      file_size_(file.size()),
      cache_(file, kSlice,
             cache_bytes != 0 ? cache_bytes
                              : TableCache::default_size(uint64_t{g.bat_entries} * kBatEntrySize, kSlice)) {}

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

uint64_t BatMap::slice_host(uint64_t index) const { return bat_offset_ + index / kEntriesPerSlice * kSlice; }

BatMap::Where BatMap::where(uint64_t index) const {
  const uint64_t host = slice_host(index);
  if (host >= file_size_) return Where::past_eof;
  return file_size_ - host >= kSlice ? Where::cache : Where::tail;
}

std::optional<uint64_t> BatMap::entry_in_memory(uint64_t index) {
  const size_t at = index % kEntriesPerSlice * kBatEntrySize;
  switch (where(index)) {
    case Where::past_eof: return uint64_t{0};
    case Where::tail: return load_le64(tail_.data() + at);
    case Where::cache: break;
  }
  auto ref = cache_.try_get(slice_host(index));
  if (!ref) return std::nullopt;
  return ref->le64(at);
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
  co_return classify(ref->le64(index % kEntriesPerSlice * kBatEntrySize), guest, len);
}

}  // namespace qcowfs::image::vhdx
