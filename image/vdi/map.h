// VdiMap: the ExtentMap of a VDI image over its block map, read whole at
// open (unchanged afterwards on read-only opens). Entries are classified as
// QEMU's vdi_co_preadv() and vdi_co_block_status() do: an allocated entry
// (below 0xfffffffe) names the data block at offset_data + entry * block_size
// (block_extra is ignored, as QEMU ignores it); unallocated and discarded
// blocks read as zeros and are reported "present, zero". An entry QEMU's
// check calls corrupt (not below blocks_in_image) reads as EIO here.
// Entries change only through publish() (VdiWriter: blocks it allocated,
// discarded or moved).
// Thread-safety: try_map() may run concurrently on any thread with one
// publish() at a time (entries are atomic). The host file must outlive the map.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "image/extent/driver.h"
#include "image/vdi/header.h"

namespace qcowfs::image::vdi {

class VdiMap final : public ExtentMap {
 public:
  // bmap: the first header.blocks_for_disk() entries, host order.
  VdiMap(io::HostFile& file, std::string path, const Header& header, std::vector<uint32_t> bmap);

  Result<std::optional<Extent>> try_map(uint64_t guest, uint64_t len) override;
  // The block map entry of block (< the blocks that map the disk).
  uint32_t entry(uint64_t block) const;
  // Block's entry is now `entry` (a data block whose data is written, or
  // kDiscarded), not yet on disk.
  void publish(uint64_t block, uint32_t entry);
  uint64_t blocks() const { return bmap_.size(); }
  // The data area starts at offset_data from now on (VdiWriter, while no
  // entry names a data block; the next publish() orders it for readers).
  void set_offset_data(uint32_t offset_data) { offset_data_.store(offset_data, std::memory_order_relaxed); }

 private:
  Extent zero_run(uint64_t block, uint64_t guest, uint64_t len) const;
  Result<Extent> data_run(uint64_t block, uint64_t guest, uint64_t len) const;
  bool valid(uint32_t entry) const { return entry < h_.blocks_in_image; }

  io::HostFile& file_;
  std::string path_;
  Header h_;
  std::atomic<uint32_t> offset_data_;
  std::vector<uint32_t> bmap_;
};

}  // namespace qcowfs::image::vdi
