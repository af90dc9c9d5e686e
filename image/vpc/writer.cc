#include "image/vpc/writer.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "image/endian.h"
#include "image/vpc/format.h"
#include "io/align.h"

namespace qcowfs::image::vpc {
namespace {

uint64_t block_bytes(const DynHeader& h) { return bitmap_size(h.block_size) + h.block_size; }

// A metadata range [lo, hi) of the file, for the overlap checks.
struct Piece {
  uint64_t lo = 0;
  uint64_t hi = 0;
  const char* what = "";
};

Status refuse(const std::string& path, const std::string& what) {
  return Status::errorf(EIO, "{}: {}; qcowfs does not write to this VHD image (mount it read-only)", path, what);
}

// The BAT index of the block at `sector`, after `after` (for messages).
uint64_t block_at(const DynamicMap& map, uint32_t sector, uint64_t after = UINT64_MAX) {
  for (uint64_t b = after == UINT64_MAX ? 0 : after + 1; b < map.entries(); ++b)
    if (map.entry(b) == sector) return b;
  return UINT64_MAX;
}

}  // namespace

uint64_t free_data_block_offset(const DynHeader& h, const DynamicMap& map) {
  uint64_t end = align_up(h.table_offset + uint64_t{h.max_table_entries} * 4, kSector);
  for (uint64_t b = 0; b < map.entries(); ++b) {
    const uint32_t e = map.entry(b);
    if (e != kBatUnallocated) end = std::max(end, uint64_t{e} * kSector + block_bytes(h));
  }
  return end;
}

// The allocated blocks' sectors, sorted (4 bytes each: no more than the BAT
// itself), checked against each other and against each metadata range.
Status check_layout(const Layout& l, const DynamicMap& map, const std::string& path) {
  const uint64_t stride = block_bytes(l.dyn);
  const std::array<Piece, 3> meta = {Piece{0, kFooterSize, "footer copy"},
                                     Piece{l.header_offset, l.header_offset + kDynHeaderSize, "dynamic disk header"},
                                     // The BAT's whole sectors: write_metadata() writes them back.
                                     Piece{VpcWriter::bat_base(l.dyn), VpcWriter::bat_end(l.dyn), "BAT"}};
  if (meta[1].hi > l.free_offset)
    return refuse(path, fmt::format("the dynamic disk header at {:#x} lies where new blocks go ({:#x} on)",
                                    l.header_offset, l.free_offset));
  const uint64_t bat_lo = l.dyn.table_offset, bat_hi = bat_lo + uint64_t{l.dyn.max_table_entries} * 4;
  for (size_t m = 0; m < 2; ++m)
    if (bat_lo < meta[m].hi && meta[m].lo < bat_hi)
      return refuse(path, fmt::format("the BAT at {:#x} overlaps the {} at {:#x}", bat_lo, meta[m].what, meta[m].lo));
  if (l.file_size < kFooterSize || l.free_offset > l.file_size - kFooterSize)
    return refuse(path, fmt::format("the data ending at {:#x} reaches into the end footer (the last {} bytes of the "
                                    "file, {} bytes long)",
                                    l.free_offset, kFooterSize, l.file_size));
  std::vector<uint32_t> sectors;
  for (uint64_t b = 0; b < map.entries(); ++b)
    if (map.entry(b) != kBatUnallocated) sectors.push_back(map.entry(b));
  std::sort(sectors.begin(), sectors.end());
  for (size_t i = 1; i < sectors.size(); ++i) {
    if (uint64_t{sectors[i]} * kSector >= uint64_t{sectors[i - 1]} * kSector + stride) continue;
    const uint64_t a = block_at(map, sectors[i - 1]);
    const uint64_t b = block_at(map, sectors[i], sectors[i] == sectors[i - 1] ? a : UINT64_MAX);
    return refuse(path, fmt::format("block {} at {:#x} overlaps block {} at {:#x}", b, uint64_t{sectors[i]} * kSector,
                                    a, uint64_t{sectors[i - 1]} * kSector));
  }
  for (const Piece& m : meta) {
    // The first block ending after m starts: blocks do not overlap, so no later one can start before it.
    auto it = std::upper_bound(sectors.begin(), sectors.end(), m.lo,
                               [stride](uint64_t lo, uint32_t s) { return lo < uint64_t{s} * kSector + stride; });
    if (it == sectors.end() || uint64_t{*it} * kSector >= m.hi) continue;
    return refuse(path, fmt::format("the {} at {:#x} overlaps block {} at {:#x}", m.what, m.lo, block_at(map, *it),
                                    uint64_t{*it} * kSector));
  }
  return Status::ok();
}

uint64_t VpcWriter::bat_base(const DynHeader& h) { return align_down(h.table_offset, kSector); }

uint64_t VpcWriter::bat_end(const DynHeader& h) {
  return align_up(h.table_offset + uint64_t{h.max_table_entries} * 4, kSector);
}

VpcWriter::VpcWriter(io::HostFile& file, std::string path, const Layout& l, DynamicMap& map, io::AlignedBuffer footer,
                     io::AlignedBuffer bat)
    : file_(file),
      path_(std::move(path)),
      l_(l),
      map_(map),
      footer_(std::move(footer)),
      bat_(std::move(bat)),
      bitmap_(static_cast<size_t>(bitmap_size(l.dyn.block_size)), file.mem_align(), false),
      align_(new_block_align(l.dyn.block_size, file.is_block_device())),
      pad_(new_block_pad(l.dyn.block_size, align_)),
      prefix_(static_cast<size_t>(pad_ + bitmap_.size()), file.mem_align(), true),
      free_offset_(l.free_offset),
      footer_at_(l.free_offset),
      zero_from_(file.size()),
      bitmap_full_(std::make_unique<std::atomic<uint64_t>[]>((map.entries() + 63) / 64)) {
  std::memset(bitmap_.data(), 0xff, bitmap_.size());
  std::memset(prefix_.data() + pad_, 0xff, bitmap_.size());
}

// New blocks are numbered by their first sector: the last one must be below
// kBatUnallocated. On a block device the blocks and the footer must fit.
Task<Result<HostRun>> VpcWriter::reserve(uint64_t /*first*/, uint64_t n) {
  const uint64_t stride = unit_stride();
  const uint64_t host = pad_ == 0 ? free_offset_ : align_up(free_offset_, align_);
  const uint64_t end = host + n * stride;
  if ((end - stride + pad_) / kSector >= kBatUnallocated)
    co_return Status::errorf(ENOSPC, "the VHD image has no room for more blocks (BAT entries are 32-bit sectors)");
  if (file_.is_block_device() && end + kFooterSize > file_.size())
    co_return Status::errorf(ENOSPC, "the VHD image's block device is full ({} bytes)", file_.size());
  HostRun run;
  run.file = &file_;
  run.host = host;
  run.units = n;
  // The old footer lies before the first unit's data: under its prefix, or in
  // the unused space before the aligned start.
  run.fresh = zero_from_ <= run.host + prefix_.size();
  run.prefix_hole = padding_hole(host);
  free_offset_ = end;
  co_return run;
}

// The leading padding of a block at `host` that is not written: all of it
// before the host-aligned part that holds the bitmap (nothing reads it), but
// an old end footer inside it is written over, with the padding from the
// footer's aligned start on, rather than left in the file.
uint64_t VpcWriter::padding_hole(uint64_t host) const {
  const uint64_t align = std::max<uint64_t>(file_.mem_align(), file_.offset_align());
  const uint64_t hole = align_down(pad_, align);
  if (footer_at_ >= host && footer_at_ < host + hole) return align_down(footer_at_ - host, align);
  return hole;
}

// The run's space may hold part of the failed write now: no longer fresh.
void VpcWriter::unreserve(const HostRun& run) {
  free_offset_ = run.host;
  zero_from_ = std::max(zero_from_, run.host + run.units * unit_stride());
}

void VpcWriter::publish(uint64_t first, const HostRun& run) {
  const uint64_t stride = unit_stride();
  const uint64_t at = l_.dyn.table_offset - bat_base(l_.dyn);
  for (uint64_t i = 0; i < run.units; ++i) {
    const auto sector = static_cast<uint32_t>((run.host + i * stride + pad_) / kSector);
    map_.publish(first + i, sector);
    store_be32(bat_.data() + at + (first + i) * 4, sector);
    set_bitmap_full(first + i);  // written all ones with the block
  }
  dirty_.add(first, run.units);
}

// The footer first, flushed: then the file covers every new block before any
// BAT entry names one (a crash in between leaves blocks no entry names, which
// QEMU and qcowfs write over).
Task<Status> VpcWriter::write_metadata() {
  if (!dirty()) co_return Status::ok();
  if (footer_at_ != free_offset_) {
    QCOWFS_CO_TRY(co_await file_.write(free_offset_, footer_.span()));
    QCOWFS_CO_TRY(co_await file_.flush());
    footer_at_ = free_offset_;
  }
  if (!dirty_.empty()) {
    const auto [from, to] = dirty_.sectors(l_.dyn.table_offset - bat_base(l_.dyn), 4, kSector);
    auto bytes = bat_.span().subspan(static_cast<size_t>(from), static_cast<size_t>(to - from));
    QCOWFS_CO_TRY(co_await file_.write(bat_base(l_.dyn) + from, bytes));
    dirty_.clear();
  }
  co_return Status::ok();
}

bool VpcWriter::needs_before_unit_write(uint64_t block) const {
  return (bitmap_full_[block / 64].load(std::memory_order_acquire) >> (block % 64) & 1) == 0;
}

void VpcWriter::set_bitmap_full(uint64_t block) {
  bitmap_full_[block / 64].fetch_or(uint64_t{1} << (block % 64), std::memory_order_release);
}

// The bits of the block's sectors (most significant bit first); the padding
// up to bitmap_size() is not looked at.
bool VpcWriter::all_ones(std::span<const std::byte> bitmap) const {
  const uint64_t sectors = l_.dyn.block_size / kSector;
  const auto full = static_cast<size_t>(sectors / 8);
  if (!std::all_of(bitmap.begin(), bitmap.begin() + static_cast<std::ptrdiff_t>(full),
                   [](std::byte b) { return b == std::byte{0xff}; }))
    return false;
  const unsigned rest = sectors % 8;
  const auto mask = static_cast<uint8_t>(0xff00u >> rest);
  return rest == 0 || (static_cast<uint8_t>(bitmap[full]) & mask) == mask;
}

// As QEMU's get_image_offset(..., write=true), which writes an all-ones
// bitmap with bdrv_pwrite_sync before writing into a block; here the bitmap
// is read first and rewritten only when a bit is clear.
Task<Status> VpcWriter::before_unit_write(uint64_t block) {
  if (!needs_before_unit_write(block)) co_return Status::ok();
  const uint32_t sector = map_.entry(block);
  if (sector == kBatUnallocated) co_return Status::ok();  // a new block gets its bitmap with its data
  const uint64_t at = uint64_t{sector} * kSector;
  io::AlignedBuffer old(bitmap_.size(), file_.mem_align(), true);
  auto got = co_await file_.read(at, old.span());
  if (!got) co_return got.status().with_context(fmt::format("reading the sector bitmap of VHD block {}", block));
  if (*got < old.size() || !all_ones(old.span())) {
    Status st = co_await file_.write(at, bitmap_.span());
    if (st) st = co_await file_.flush();
    if (!st) co_return st.with_context(fmt::format("rewriting the sector bitmap of VHD block {} all ones", block));
  }
  set_bitmap_full(block);
  co_return Status::ok();
}

}  // namespace qcowfs::image::vpc
