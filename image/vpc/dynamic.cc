#include "image/vpc/dynamic.h"

#include <algorithm>
#include <atomic>

#include "image/vpc/format.h"

namespace qcowfs::image::vpc {

DynamicMap::DynamicMap(io::HostFile* file, uint32_t block_size, std::vector<uint32_t> bat)
    : file_(file), block_size_(block_size), bitmap_size_(vpc::bitmap_size(block_size)), bat_(std::move(bat)) {}

// Entries are read while VpcWriter publishes new ones from another thread.
uint32_t DynamicMap::entry(uint64_t block) const {
  return std::atomic_ref<uint32_t>(const_cast<uint32_t&>(bat_[block])).load(std::memory_order_acquire);
}

void DynamicMap::publish(uint64_t block, uint32_t sector) {
  std::atomic_ref<uint32_t>(bat_[block]).store(sector, std::memory_order_release);
}

bool DynamicMap::allocated(uint64_t block) const { return block < bat_.size() && entry(block) != kBatUnallocated; }

Result<std::optional<Extent>> DynamicMap::try_map(uint64_t guest, uint64_t len) {
  uint64_t block = guest / block_size_;
  const uint64_t in_block = guest % block_size_;
  Extent e;
  e.length = std::min(len, block_size_ - in_block);
  if (allocated(block)) {
    // The next block's data never continues this one's: its bitmap lies between.
    e.kind = ExtentKind::data;
    e.file = file_;
    e.host_offset = uint64_t{entry(block)} * kSector + bitmap_size_ + in_block;
    return std::optional<Extent>(e);
  }
  e.kind = ExtentKind::zero;
  while (e.length < len && !allocated(++block)) e.length = std::min(len, e.length + block_size_);
  return std::optional<Extent>(e);
}

}  // namespace qcowfs::image::vpc
