// Opening a VHDX image, in QEMU's order (vhdx_open): file signature, current
// header, log (replayed on a read-write open), region table, metadata, BAT
// check; then the ExtentDriver, with a VhdxWriter on a read-write open.
#include <cstring>
#include <limits>
#include <optional>

#include "image/endian.h"
#include "image/extent/host_read.h"
#include "image/vhdx/bat.h"
#include "image/vhdx/format.h"
#include "image/vhdx/header.h"
#include "image/vhdx/log.h"
#include "image/vhdx/log_writer.h"
#include "image/vhdx/vhdx.h"
#include "image/vhdx/vhdx_check.h"
#include "image/vhdx/writer.h"
#include "io/buffer.h"
#include "io/log.h"

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

struct HeaderBlocks {
  io::AlignedBuffer h1, h2;
};

Task<Result<HeaderBlocks>> read_header_blocks(io::HostFile& f) {
  auto h1 = co_await read_at(f, kHeaderOffsets[0], kHeaderSize, "header");
  if (!h1) co_return h1.status();
  auto h2 = co_await read_at(f, kHeaderOffsets[1], kHeaderSize, "header");
  if (!h2) co_return h2.status();
  co_return HeaderBlocks{std::move(*h1), std::move(*h2)};
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

// What a read-write open needs besides the map: the log replayed (as
// vhdx_parse_log on a read-write open), the header pair that writes go through.
struct WriteState {
  std::optional<HeaderPair> headers;
  uint64_t next_sequence = 1;
  bool replayed = false;
};


// The log checks a writable open adds: the log region inside the file and
// large enough for an entry (QEMU's writer fails without one).
Status check_log_writable(const Header& h, uint64_t file_size, const std::string& path) {
  if (max_entry_sectors(h.log_length) == 0)
    return refuse_writable(path, fmt::format("the VHDX log ({} bytes) is too small to write", h.log_length));
  if (h.log_offset > file_size || h.log_length > file_size - h.log_offset)
    return refuse_writable(path, "the VHDX log runs past the end of the file");
  return Status::ok();
}

// The current header; on a read-write open the log replayed first (and the
// header then read again), on a read-only open refused if it needs replay.
Task<Result<Header>> open_header(io::HostFile& f, const std::string& path, bool writable, WriteState& ws) {
  auto blocks = co_await read_header_blocks(f);
  if (!blocks) co_return blocks.status();
  auto header = choose_header(blocks->h1.span(), blocks->h2.span(), path);
  if (!header) co_return header.status();
  if (!writable) {
    QCOWFS_CO_TRY(co_await check_log(f, *header, path));
    co_return *header;
  }
  QCOWFS_CO_TRY(check_log_fields(*header, path));
  QCOWFS_CO_TRY(check_log_writable(*header, f.size(), path));
  auto seq = co_await find_log_sequence(f, *header, path);
  if (!seq) co_return seq.status();
  ws.headers.emplace(f, std::move(blocks->h1), std::move(blocks->h2), header->index, path);
  if (!seq->valid) co_return *header;
  auto plan = co_await read_log_writes(f, *header, *seq, path);
  if (!plan) co_return plan.status();
  log::info("{}: replaying the VHDX log ({} entries from sequence number {})", path, seq->count, seq->first_sequence);
  QCOWFS_CO_TRY(co_await replay(f, *ws.headers, *plan, path));
  ws.next_sequence = plan->next_sequence;
  ws.replayed = true;
  co_return choose_header(ws.headers->block(0), ws.headers->block(1), path);
}

// vhdx_open up to the BAT check: the signature, the header (the log replayed
// first when writable), the regions, the parameters and the geometry.
Task<Result<Layout>> open_layout(io::HostFile& f, const std::string& path, bool writable, WriteState& ws) {
  QCOWFS_CO_TRY(co_await check_signature(f, path));
  auto header = co_await open_header(f, path, writable, ws);
  if (!header) co_return header.status();
  auto regions = co_await read_regions(f, *header, path);
  if (!regions) co_return regions.status();
  if (regions->bat.offset > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) - regions->bat.length)
    co_return Status::errorf(EINVAL, "{}: the VHDX BAT region offset {:#x} is out of range", path, regions->bat.offset);
  auto params = co_await read_parameters(f, *regions, path);
  if (!params) co_return params.status();
  auto geometry = make_geometry(*params, regions->bat.length, path);
  if (!geometry) co_return geometry.status();
  co_return Layout{*header, std::move(*regions), *params, *geometry, false};
}

Task<Result<std::unique_ptr<BlockDriver>>> open(std::unique_ptr<io::HostFile> file, std::string path,
                                                const ImageOptions& opts) {
  io::HostFile& f = *file;
  const bool writable = opts.file.writable;
  WriteState ws;
  auto layout = co_await open_layout(f, path, writable, ws);
  if (!layout) co_return layout.status();
  const Header* header = &layout->header;
  const Regions* regions = &layout->regions;
  const Parameters* params = &layout->params;
  const Geometry* geometry = &layout->geometry;
  QCOWFS_CO_TRY(co_await check_bat(f, *geometry, *regions, path));
  VhdxWriter::Params wp;
  if (writable) {
    auto first_free = co_await check_bat_writable(f, *geometry, *regions, path);
    if (!first_free) co_return first_free.status();
    const bool fixed = (params->flags & kLeaveBlocksAllocated) != 0;
    wp = VhdxWriter::Params{*geometry, *header, *first_free, ws.next_sequence, ws.replayed, fixed};
  }
  auto map = std::make_unique<BatMap>(f, *geometry, regions->bat.offset, path, opts.table_cache_size);
  QCOWFS_CO_TRY(co_await map->init());
  ExtentImage img;
  img.format = "vhdx";
  img.path = path;
  img.size = geometry->size;
  if (writable) img.writer = std::make_unique<VhdxWriter>(f, path, wp, *map, std::move(*ws.headers));
  img.files.push_back(std::move(file));
  img.map = std::move(map);
  img.details = details_of(*geometry);
  img.reports_status = false;  // QEMU's vhdx driver has no block-status callback
  co_return std::unique_ptr<BlockDriver>(std::make_unique<ExtentDriver>(std::move(img)));
}

}  // namespace

Task<Result<Layout>> open_for_check(io::HostFile& file, const std::string& path, bool replay) {
  WriteState ws;
  auto layout = co_await open_layout(file, path, replay, ws);
  if (!layout) co_return layout.status();
  layout->replayed = ws.replayed;
  co_return layout;
}

}  // namespace vhdx

Task<Result<std::unique_ptr<BlockDriver>>> open_vhdx(std::unique_ptr<io::HostFile> file, std::string path,
                                                     ImageOptions opts) {
  co_return co_await vhdx::open(std::move(file), std::move(path), opts);
}

}  // namespace qcowfs::image
