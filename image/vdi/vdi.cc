// open_vdi(): header, block map, then an ExtentDriver.
#include "image/vdi/vdi.h"

#include <algorithm>
#include <cstring>

#include "image/endian.h"
#include "image/extent/driver.h"
#include "image/extent/host_read.h"
#include "image/vdi/format.h"
#include "image/vdi/header.h"
#include "image/vdi/map.h"
#include "image/vdi/writer.h"

namespace qcowfs::image {
namespace {

using vdi::Header;

// The entries of the block map that map the disk. QEMU reads all
// blocks_in_image entries (zeros past the end of the file); we read only what
// the disk needs, and only from inside the file, so a hostile header cannot
// make us allocate more than the file holds (or kMaxBlockMapBytes).
Task<Result<std::vector<uint32_t>>> read_block_map(io::HostFile& file, const Header& h, const std::string& path) {
  const uint64_t entries = h.blocks_for_disk();
  const uint64_t bytes = entries * sizeof(uint32_t);
  if (bytes > vdi::kMaxBlockMapBytes)
    co_return Status::errorf(EINVAL, "{}: the VDI block map of {} blocks is larger than qcowfs reads ({} bytes)", path,
                             entries, vdi::kMaxBlockMapBytes);
  if (uint64_t{h.offset_bmap} + bytes > file.size())
    co_return Status::errorf(EINVAL,
                             "{}: the VDI block map ({} entries at offset_bmap {:#x}) runs past the end of "
                             "the file",
                             path, entries, h.offset_bmap);
  std::vector<std::byte> raw(static_cast<size_t>(bytes));
  auto st = co_await read_padded(file, h.offset_bmap, raw);
  if (!st) co_return st.with_context(path + ": reading the VDI block map");
  std::vector<uint32_t> bmap(static_cast<size_t>(entries));
  for (size_t i = 0; i < bmap.size(); ++i) bmap[i] = load_le32(raw.data() + i * sizeof(uint32_t));
  co_return bmap;
}

// A new block goes at index blocks_allocated (as in QEMU): refused where that
// could overwrite a block in use, i.e. an entry at or past blocks_allocated,
// two blocks naming one data block, or more blocks allocated than the image
// has. QEMU writes such images anyway; qemu-img check calls them corrupt.
Status check_allocation(const Header& h, const vdi::VdiMap& map, const std::string& path) {
  const auto refuse = [&](std::string what) {
    return Status::errorf(EIO, "{}: {}; qcowfs does not write to this VDI image (mount it read-only)", path, what);
  };
  if (h.blocks_allocated > h.blocks_in_image)
    return refuse(
        fmt::format("blocks_allocated {} is above blocks_in_image {}", h.blocks_allocated, h.blocks_in_image));
  std::vector<uint32_t> named;  // no larger than the block map already read
  for (uint64_t block = 0; block < map.blocks(); ++block) {
    const uint32_t e = map.entry(block);
    if (!vdi::is_allocated(e)) continue;
    if (e >= h.blocks_allocated)
      return refuse(
          fmt::format("block {} names data block {}, not below blocks_allocated {}", block, e, h.blocks_allocated));
    named.push_back(e);
  }
  std::sort(named.begin(), named.end());
  auto twice = std::adjacent_find(named.begin(), named.end());
  if (twice != named.end()) return refuse(fmt::format("data block {} is named by two blocks", *twice));
  return Status::ok();
}

// The writer of a read-write open, with the header and block map bytes it
// writes back.
Task<Result<std::unique_ptr<ExtentWriter>>> make_writer(io::HostFile& file, const std::string& path, const Header& h,
                                                        vdi::VdiMap& map) {
  QCOWFS_CO_TRY(check_allocation(h, map, path));
  const uint64_t base = vdi::VdiWriter::meta_base(h);
  io::AlignedBuffer meta(static_cast<size_t>(vdi::VdiWriter::meta_end(h) - base), file.mem_align(), true);
  auto st = co_await read_padded(file, base, meta.span());
  if (!st) co_return st.with_context(path + ": reading the VDI block map");
  io::AlignedBuffer header;  // the header is in meta when they are written together
  if (base != 0) {
    header = io::AlignedBuffer(vdi::kHeaderBytes, file.mem_align(), true);
    QCOWFS_CO_TRY(co_await read_padded(file, 0, header.span()));
  }
  co_return std::unique_ptr<ExtentWriter>(
      std::make_unique<vdi::VdiWriter>(file, path, h, map, std::move(header), std::move(meta)));
}

}  // namespace

Task<Result<std::unique_ptr<BlockDriver>>> open_vdi(std::unique_ptr<io::HostFile> file, std::string path,
                                                    ImageOptions opts) {
  auto h = co_await vdi::read_header(*file, path);
  if (!h) co_return h.status();
  auto bmap = co_await read_block_map(*file, *h, path);
  if (!bmap) co_return bmap.status();

  ExtentImage img;
  img.format = "vdi";
  img.path = path;
  img.size = h->disk_size;
  img.details.cluster_size = h->block_size;
  img.details.dirty = false;  // qemu-img info prints "dirty-flag": false (vdi_get_info)
  auto map = std::make_unique<vdi::VdiMap>(*file, path, *h, std::move(*bmap));
  if (opts.file.writable) QCOWFS_CO_TRY(take_writer(img, co_await make_writer(*file, path, *h, *map)));
  co_return one_file_driver(std::move(img), std::move(map), std::move(file));
}

}  // namespace qcowfs::image
