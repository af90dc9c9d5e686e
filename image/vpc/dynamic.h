// The ExtentMap of a dynamic (or differencing) VHD: the whole BAT in memory,
// as QEMU keeps it. A guest byte in block i lives at bat[i] * 512 +
// bitmap_size + its offset in the block; the sector bitmap is not consulted
// (QEMU's get_image_offset() ignores it). Unallocated blocks read as zeros and
// are reported as zero ("present": true, "zero": true), as QEMU does.
// Entries change only through publish() (VpcWriter, for blocks it allocated).
// Thread-safety: try_map() may run concurrently on any thread with one
// publish() at a time (entries are atomic). The host file must outlive the map.
#pragma once

#include <cstdint>
#include <vector>

#include "image/extent/driver.h"

namespace qcowfs::image::vpc {

class DynamicMap final : public ExtentMap {
 public:
  // Every allocated entry's block lies inside file (the opener checked it).
  DynamicMap(io::HostFile* file, uint32_t block_size, std::vector<uint32_t> bat);
  Result<std::optional<Extent>> try_map(uint64_t guest, uint64_t len) override;
  // The BAT entry of block (< entries()): a sector number or kBatUnallocated.
  uint32_t entry(uint64_t block) const;
  uint64_t entries() const { return bat_.size(); }
  // Block now maps to the block at sector `sector` (allocated, written, not
  // yet on disk).
  void publish(uint64_t block, uint32_t sector);

 private:
  bool allocated(uint64_t block) const;

  io::HostFile* file_;
  uint64_t block_size_;
  uint64_t bitmap_size_;
  std::vector<uint32_t> bat_;
};

}  // namespace qcowfs::image::vpc
