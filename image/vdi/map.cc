#include "image/vdi/map.h"

#include <algorithm>
#include <atomic>

#include "io/log.h"

namespace qcowfs::image::vdi {

// Entries are read while VdiWriter publishes new ones from another thread.
uint32_t VdiMap::entry(uint64_t block) const {
  return std::atomic_ref<uint32_t>(const_cast<uint32_t&>(bmap_[block])).load(std::memory_order_acquire);
}

void VdiMap::publish(uint64_t block, uint32_t entry) {
  std::atomic_ref<uint32_t>(bmap_[block]).store(entry, std::memory_order_release);
}

VdiMap::VdiMap(io::HostFile& file, std::string path, const Header& header, std::vector<uint32_t> bmap)
    : file_(file), path_(std::move(path)), h_(header), offset_data_(header.offset_data), bmap_(std::move(bmap)) {}

// Unallocated and discarded blocks from `block` on: zeros.
Extent VdiMap::zero_run(uint64_t block, uint64_t guest, uint64_t len) const {
  uint64_t end = (block + 1) * h_.block_size;
  while (end - guest < len && block + 1 < bmap_.size() && !is_allocated(entry(block + 1))) {
    ++block;
    end += h_.block_size;
  }
  Extent e;
  e.kind = ExtentKind::zero;
  e.length = std::min(len, end - guest);
  return e;
}

// Data blocks from `block` on whose data blocks follow each other.
Result<Extent> VdiMap::data_run(uint64_t block, uint64_t guest, uint64_t len) const {
  const uint32_t first = entry(block);
  if (!valid(first)) {
    std::string what = fmt::format(
        "{}: invalid VDI block map entry {} of block {}: not below blocks_in_image {} "
        "(guest offset {:#x})",
        path_, first, block, h_.blocks_in_image, guest);
    log::error("{}", what);
    return Status::error(EIO, std::move(what));
  }
  uint64_t end = (block + 1) * h_.block_size;
  uint32_t expect = first;
  while (end - guest < len && block + 1 < bmap_.size()) {
    const uint32_t next = entry(block + 1);
    if (!valid(next) || next != expect + 1) break;
    expect = next;
    ++block;
    end += h_.block_size;
  }
  Extent e;
  e.kind = ExtentKind::data;
  e.file = &file_;
  const uint64_t data = offset_data_.load(std::memory_order_relaxed);
  e.host_offset = data + uint64_t{first} * h_.block_size + guest % h_.block_size;
  e.length = std::min(len, end - guest);
  // Static images: QEMU's BDRV_BLOCK_RECURSE asks the host file for holes.
  e.host_holes_are_zero = h_.is_static();
  return e;
}

Result<std::optional<Extent>> VdiMap::try_map(uint64_t guest, uint64_t len) {
  const uint64_t block = guest / h_.block_size;
  if (block >= bmap_.size()) return Status::errorf(EIO, "{}: guest offset {:#x} is past the block map", path_, guest);
  if (!is_allocated(entry(block))) return std::optional<Extent>(zero_run(block, guest, len));
  auto e = data_run(block, guest, len);
  if (!e) return e.status();
  return std::optional<Extent>(*e);
}

}  // namespace qcowfs::image::vdi
