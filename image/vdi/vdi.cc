// open_vdi(): header, block map, then an ExtentDriver.
#include "image/vdi/vdi.h"

#include <cstring>

#include "image/endian.h"
#include "image/extent_driver.h"
#include "image/host_read.h"
#include "image/vdi/format.h"
#include "image/vdi/header.h"
#include "image/vdi/map.h"

namespace qcowfs::image {
namespace {

using vdi::Header;

Task<Result<Header>> read_header(io::HostFile& file, const std::string& path) {
  std::vector<std::byte> bytes(vdi::kHeaderBytes);
  QCOWFS_CO_TRY(co_await read_padded(file, 0, bytes));
  co_return vdi::parse_header(bytes, path);
}

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
    co_return Status::errorf(EINVAL, "{}: the VDI block map ({} entries at offset_bmap {:#x}) runs past the end of "
                             "the file", path, entries, h.offset_bmap);
  std::vector<std::byte> raw(static_cast<size_t>(bytes));
  auto st = co_await read_padded(file, h.offset_bmap, raw);
  if (!st) co_return st.with_context(path + ": reading the VDI block map");
  std::vector<uint32_t> bmap(static_cast<size_t>(entries));
  for (size_t i = 0; i < bmap.size(); ++i) bmap[i] = load_le32(raw.data() + i * sizeof(uint32_t));
  co_return bmap;
}

}  // namespace

Task<Result<std::unique_ptr<BlockDriver>>> open_vdi(std::unique_ptr<io::HostFile> file, std::string path,
                                                    ImageOptions opts) {
  QCOWFS_CO_TRY(refuse_writable_open("VDI", path, opts));
  auto h = co_await read_header(*file, path);
  if (!h) co_return h.status();
  auto bmap = co_await read_block_map(*file, *h, path);
  if (!bmap) co_return bmap.status();

  ExtentImage img;
  img.format = "vdi";
  img.path = path;
  img.size = h->disk_size;
  img.details.cluster_size = h->block_size;
  img.details.dirty = false;  // qemu-img info prints "dirty-flag": false (vdi_get_info)
  img.map = std::make_unique<vdi::VdiMap>(*file, path, *h, std::move(*bmap));
  img.files.push_back(std::move(file));
  co_return std::unique_ptr<BlockDriver>(std::make_unique<ExtentDriver>(std::move(img)));
}

}  // namespace qcowfs::image
