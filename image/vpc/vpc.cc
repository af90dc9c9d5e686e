// open_vpc(): QEMU 7.2's vpc_open() (block/vpc.c) over our HostFile: footer,
// size rule, dynamic-disk header and BAT, then an ExtentDriver over a FixedMap
// or a DynamicMap; read-write: fixed disks in place, dynamic ones through a
// VpcWriter.
#include "image/vpc/vpc.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "image/endian.h"
#include "image/extent/driver.h"
#include "image/extent/host_read.h"
#include "image/vpc/dynamic.h"
#include "image/vpc/fixed.h"
#include "image/vpc/format.h"
#include "image/vpc/header.h"
#include "image/vpc/writer.h"

namespace qcowfs::image {
namespace {

using vpc::kSector;

struct FoundFooter {
  vpc::Footer footer;
  bool at_start = false;  // a dynamic disk's copy at offset 0 (QEMU reads that one first)
};

// The footer copy at offset 0, else the footer at the end, which must then
// be a fixed disk's (vpc_open).
Task<Result<FoundFooter>> find_footer(io::HostFile& file, const std::string& path) {
  std::array<std::byte, vpc::kFooterSize> b;
  QCOWFS_CO_TRY(co_await read_padded(file, 0, b, "VHD footer copy"));
  if (vpc::has_cookie(b, vpc::kFooterCookie)) {
    auto f = vpc::parse_footer(b, path);
    if (!f) co_return f.status();
    co_return FoundFooter{*f, true};
  }
  const uint64_t size = file.size();
  if (size < vpc::kFooterSize) co_return Status::errorf(EINVAL, "{}: file too small for a VHD footer", path);
  QCOWFS_CO_TRY(co_await read_padded(file, size - vpc::kFooterSize, b, "VHD footer"));
  if (!vpc::has_cookie(b, vpc::kFooterCookie) || load_be32(&b[vpc::kFooterTypeOff]) != vpc::kFixed)
    co_return Status::errorf(EINVAL, "{}: invalid VPC image (no footer at 0 and no fixed-disk footer at the end)",
                             path);
  auto f = vpc::parse_footer(b, path);
  if (!f) co_return f.status();
  co_return FoundFooter{*f, false};
}

Task<Result<vpc::DynHeader>> read_dyn_header(io::HostFile& file, const vpc::Footer& f, uint64_t sectors,
                                             const std::string& path) {
  std::array<std::byte, vpc::kDynHeaderSize> b;
  if (f.data_offset > UINT64_MAX - b.size())
    co_return Status::errorf(EINVAL, "{}: VHD dynamic header offset {:#x} is out of range", path, f.data_offset);
  QCOWFS_CO_TRY(co_await read_padded(file, f.data_offset, b, "VHD dynamic disk header"));
  co_return vpc::parse_dyn_header(b, sectors, path);
}

// The BAT, in host order, checked as vpc_open checks it: no block may end past
// the end of the file. qcowfs also refuses a BAT that runs past the end of the
// file (QEMU would read zeros there, i.e. blocks at sector 0).
Task<Result<std::vector<uint32_t>>> read_bat(io::HostFile& file, const vpc::DynHeader& h, const std::string& path) {
  const uint64_t bytes = uint64_t{h.max_table_entries} * 4;
  const uint64_t fsize = file.size();
  if (h.table_offset > fsize || bytes > fsize - h.table_offset)
    co_return Status::errorf(EINVAL, "{}: VHD BAT ({} entries at {:#x}) runs past the end of the file ({} bytes)", path,
                             h.max_table_entries, h.table_offset, fsize);
  std::vector<uint32_t> bat(h.max_table_entries);
  std::span<std::byte> raw(reinterpret_cast<std::byte*>(bat.data()), bytes);
  QCOWFS_CO_TRY(co_await read_padded(file, h.table_offset, raw, "VHD BAT"));
  const uint64_t block_bytes = vpc::bitmap_size(h.block_size) + h.block_size;
  uint64_t free_offset = (h.table_offset + bytes + 511) & ~uint64_t{511};
  for (uint32_t& e : bat) {
    e = load_be32(reinterpret_cast<const std::byte*>(&e));
    if (e != vpc::kBatUnallocated) free_offset = std::max(free_offset, uint64_t{e} * kSector + block_bytes);
  }
  if (free_offset > fsize)
    co_return Status::errorf(EINVAL,
                             "{}: VHD free_data_block_offset {:#x} points after the end of the file ({} bytes): "
                             "the image has been truncated",
                             path, free_offset, fsize);
  co_return bat;
}

ImageDetails details_for(const vpc::Footer& f, uint32_t block_size) {
  ImageDetails d;
  d.dirty = false;  // qemu-img prints "dirty-flag": false (vpc has bdrv_get_info)
  if (f.type != vpc::kFixed) d.cluster_size = block_size;
  return d;
}

// Fixed disks are written in place, as QEMU writes them (nothing else in the
// file changes). A fixed disk whose data would reach the footer (a footer
// claiming more than the file holds) is refused: a write there would
// overwrite it. So is a footer at 0 that says fixed (its data would start on
// that footer).
Status fixed_writable(bool footer_at_start, uint64_t size, const io::HostFile& file, const std::string& path) {
  if (footer_at_start)
    return Status::errorf(EROFS,
                          "{}: the VHD footer at offset 0 says fixed, so the disk's data would start on it; qcowfs "
                          "opens it read-only (mount it with ro)",
                          path);
  if (file.size() < kSector || size > file.size() - kSector)
    return Status::errorf(EROFS,
                          "{}: the fixed VHD's data ({} bytes) would reach its footer at {:#x}; qcowfs "
                          "opens it read-only (mount it with ro)",
                          path, size, file.size() - std::min<uint64_t>(file.size(), kSector));
  return Status::ok();
}

// Dynamic disks are written as QEMU writes them (VpcWriter). A differencing
// disk is refused: QEMU 7.2 writes it as a dynamic one, without its parent, so
// a new block (bitmap all ones, zeros around the write) would hide the parent's
// bytes from every reader that follows the parent. Other types (QEMU reads a
// footer at 0 of any type as dynamic) are refused too.
Status dynamic_writable(const vpc::Footer& f, const std::string& path) {
  if (f.type == vpc::kDifferencing)
    return Status::errorf(EROFS,
                          "{}: qcowfs does not write differencing VHD images (QEMU writes them without their parent, "
                          "which would hide the parent's data from other readers); mount it read-only",
                          path);
  if (f.type != vpc::kDynamic)
    return Status::errorf(EROFS, "{}: VHD disk type {} is neither fixed nor dynamic; mount it read-only", path, f.type);
  return Status::ok();
}

// The writer of a dynamic disk opened read-write, with the footer copy and the
// BAT sectors it writes back; refused where a new block could spoil a byte in
// use (vpc::check_layout).
Task<Result<std::unique_ptr<ExtentWriter>>> make_dynamic_writer(io::HostFile& file, const std::string& path,
                                                                const vpc::Footer& f, const vpc::DynHeader& h,
                                                                vpc::DynamicMap& map) {
  QCOWFS_CO_TRY(dynamic_writable(f, path));
  vpc::Layout l;
  l.file_size = file.size();
  l.header_offset = f.data_offset;
  l.dyn = h;
  l.free_offset = vpc::free_data_block_offset(h, map);
  QCOWFS_CO_TRY(vpc::check_layout(l, map, path));
  io::AlignedBuffer footer(vpc::kFooterSize, file.mem_align(), true);
  QCOWFS_CO_TRY(co_await read_padded(file, 0, footer.span(), "VHD footer copy"));
  const uint64_t base = vpc::VpcWriter::bat_base(h);
  io::AlignedBuffer bat(static_cast<size_t>(vpc::VpcWriter::bat_end(h) - base), file.mem_align(), true);
  QCOWFS_CO_TRY(co_await read_padded(file, base, bat.span(), "VHD BAT"));
  co_return std::unique_ptr<ExtentWriter>(
      std::make_unique<vpc::VpcWriter>(file, path, l, map, std::move(footer), std::move(bat)));
}

}  // namespace

Task<Result<std::unique_ptr<BlockDriver>>> open_vpc(std::unique_ptr<io::HostFile> file, std::string path,
                                                    ImageOptions opts) {
  if (!opts.snapshot.empty()) co_return Status::errorf(EINVAL, "{}: VHD images have no snapshots", path);
  auto found = co_await find_footer(*file, path);
  if (!found) co_return found.status();
  const vpc::Footer& f = found->footer;
  auto sectors = vpc::virtual_sectors(f, path);
  if (!sectors) co_return sectors.status();
  ExtentImage img;
  img.format = "vpc";
  img.path = path;
  img.size = *sectors * kSector;
  img.details = details_for(f, 0);
  if (found->at_start) {
    // A footer at 0 means a dynamic-disk header, whatever the footer's type says.
    auto h = co_await read_dyn_header(*file, f, *sectors, path);
    if (!h) co_return h.status();
    auto bat = co_await read_bat(*file, *h, path);
    if (!bat) co_return bat.status();
    img.details = details_for(f, h->block_size);
    // A footer at 0 that says fixed is read as a fixed disk (vpc_co_preadv tests the type).
    if (f.type != vpc::kFixed) {
      auto map = std::make_unique<vpc::DynamicMap>(file.get(), h->block_size, std::move(*bat));
      if (opts.file.writable) {
        auto writer = co_await make_dynamic_writer(*file, path, f, *h, *map);
        if (!writer) co_return writer.status();
        img.writer = std::move(*writer);
      }
      img.map = std::move(map);
    }
  }
  if (!img.map) {
    img.map = std::make_unique<vpc::FixedMap>(file.get());
    if (opts.file.writable) QCOWFS_CO_TRY(fixed_writable(found->at_start, img.size, *file, path));
    if (opts.file.writable) img.writer = std::make_unique<InPlaceWriter>();
  }
  img.files.push_back(std::move(file));
  std::unique_ptr<BlockDriver> d = std::make_unique<ExtentDriver>(std::move(img));
  co_return d;
}

}  // namespace qcowfs::image
