// Opening a VHDX image, in QEMU's order (vhdx_open): file signature, current
// header, log, region table, metadata, BAT check; then the ExtentDriver.
#include <cstring>
#include <limits>

#include "image/endian.h"
#include "image/host_read.h"
#include "image/vhdx/bat.h"
#include "image/vhdx/format.h"
#include "image/vhdx/header.h"
#include "image/vhdx/log.h"
#include "image/vhdx/vhdx.h"
#include "io/buffer.h"

namespace qcowfs::image {
namespace vhdx {
namespace {

// len bytes at host, zeros past the end of the file (as QEMU's reads).
Task<Result<io::AlignedBuffer>> read_at(io::HostFile& f, uint64_t host, size_t len, std::string_view what) {
  io::AlignedBuffer buf(len, f.mem_align(), true);
  if (host > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) - len)
    co_return Status::errorf(EINVAL, "the VHDX {} offset {:#x} is out of range", what, host);
  Status st = co_await read_padded(f, host, buf.span());
  if (!st) co_return st.with_context(fmt::format("reading the VHDX {}", what));
  co_return buf;
}

Task<Status> check_signature(io::HostFile& f, const std::string& path) {
  auto b = co_await read_at(f, 0, sizeof kFileSignature, "file identifier");
  if (!b) co_return b.status();
  if (std::memcmp(b->data(), kFileSignature, sizeof kFileSignature) != 0)
    co_return Status::errorf(EINVAL, "{}: no 'vhdxfile' signature at offset 0", path);
  co_return Status::ok();
}

Task<Result<Header>> read_header(io::HostFile& f, const std::string& path) {
  auto h1 = co_await read_at(f, kHeaderOffsets[0], kHeaderSize, "header");
  if (!h1) co_return h1.status();
  auto h2 = co_await read_at(f, kHeaderOffsets[1], kHeaderSize, "header");
  if (!h2) co_return h2.status();
  co_return choose_header(h1->span(), h2->span(), path);
}

Task<Result<Regions>> read_regions(io::HostFile& f, const Header& h, const std::string& path) {
  auto t = co_await read_at(f, kRegionTableOffset, kRegionTableSize, "region table");
  if (!t) co_return t.status();
  co_return parse_region_table(t->span(), h, path);
}

Task<Result<uint64_t>> read_le(io::HostFile& f, uint64_t host, size_t width, std::string_view what) {
  auto b = co_await read_at(f, host, width, what);
  if (!b) co_return b.status();
  co_return width == 8 ? load_le64(b->data()) : uint64_t{load_le32(b->data())};
}

Task<Result<Parameters>> read_parameters(io::HostFile& f, const Regions& r, const std::string& path) {
  auto t = co_await read_at(f, r.metadata.offset, kMetadataTableSize, "metadata table");
  if (!t) co_return t.status();
  auto items = parse_metadata_table(t->span(), r.metadata.offset, path);
  if (!items) co_return items.status();
  Parameters p;
  auto block = co_await read_le(f, items->file_parameters, 4, "file parameters");
  auto flags = co_await read_le(f, items->file_parameters + 4, 4, "file parameters");
  auto vsize = co_await read_le(f, items->virtual_disk_size, 8, "virtual disk size");
  auto logical = co_await read_le(f, items->logical_sector_size, 4, "logical sector size");
  auto physical = co_await read_le(f, items->physical_sector_size, 4, "physical sector size");
  for (const auto* v : {&block, &flags, &vsize, &logical, &physical})
    if (!*v) co_return v->status().with_context(path);
  p.block_size = static_cast<uint32_t>(*block);
  p.flags = static_cast<uint32_t>(*flags);
  p.virtual_disk_size = *vsize;
  p.logical_sector_size = static_cast<uint32_t>(*logical);
  p.physical_sector_size = static_cast<uint32_t>(*physical);
  co_return p;
}

ImageDetails details_of(const Geometry& g) {
  ImageDetails d;
  d.cluster_size = g.block_size;
  d.dirty = false;
  return d;
}

Task<Result<std::unique_ptr<BlockDriver>>> open(std::unique_ptr<io::HostFile> file, std::string path,
                                                const ImageOptions& opts) {
  io::HostFile& f = *file;
  QCOWFS_CO_TRY(co_await check_signature(f, path));
  auto header = co_await read_header(f, path);
  if (!header) co_return header.status();
  QCOWFS_CO_TRY(co_await check_log(f, *header, path));
  auto regions = co_await read_regions(f, *header, path);
  if (!regions) co_return regions.status();
  if (regions->bat.offset > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) - regions->bat.length)
    co_return Status::errorf(EINVAL, "{}: the VHDX BAT region offset {:#x} is out of range", path, regions->bat.offset);
  auto params = co_await read_parameters(f, *regions, path);
  if (!params) co_return params.status();
  auto geometry = make_geometry(*params, regions->bat.length, path);
  if (!geometry) co_return geometry.status();
  QCOWFS_CO_TRY(co_await check_bat(f, *geometry, *regions, path));
  auto map = std::make_unique<BatMap>(f, *geometry, regions->bat.offset, path, opts.l2_cache_size);
  QCOWFS_CO_TRY(co_await map->init());
  ExtentImage img;
  img.format = "vhdx";
  img.path = path;
  img.size = geometry->size;
  img.files.push_back(std::move(file));
  img.map = std::move(map);
  img.details = details_of(*geometry);
  img.reports_status = false;  // QEMU's vhdx driver has no block-status callback
  co_return std::unique_ptr<BlockDriver>(std::make_unique<ExtentDriver>(std::move(img)));
}

}  // namespace
}  // namespace vhdx

Task<Result<std::unique_ptr<BlockDriver>>> open_vhdx(std::unique_ptr<io::HostFile> file, std::string path,
                                                     ImageOptions opts) {
  QCOWFS_CO_TRY(refuse_writable_open("VHDX", path, opts));
  co_return co_await vhdx::open(std::move(file), std::move(path), opts);
}

}  // namespace qcowfs::image
