// The VMDK guest-to-host map: extents (consecutive guest ranges, in
// descriptor order) over their host files, FLAT ones 1:1, sparse ones through
// the grain directory (in memory) and grain tables (4 KiB windows of the file
// in a TableCache). QEMU 7.2 block/vmdk.c: get_cluster_offset,
// vmdk_co_block_status, vmdk_read_extent.
// Thread-safety: the map is immutable after construction but for the
// thread-safe TableCaches; try_map() never suspends.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "image/extent_driver.h"
#include "image/table_cache.h"

namespace qcowfs::image::vmdk {

// Grain tables are read in windows of this size, aligned in the file.
constexpr size_t kGtWindow = TableCache::kDefaultSliceSize;

// One extent: a consecutive guest range in one host file.
struct VExtent {
  uint64_t start = 0;  // guest bytes
  uint64_t size = 0;   // guest bytes
  io::HostFile* file = nullptr;
  bool flat = false;
  uint64_t flat_offset = 0;  // bytes
  // Sparse extents:
  bool compressed = false, markers = false, zero_grain = false;
  uint64_t grain_bytes = 0;
  uint32_t gtes = 0;         // entries per grain table
  uint64_t gd_coverage = 0;  // bytes one GD entry maps (QEMU's l1_entry_sectors)
  uint32_t gd_size = 0;      // GD entries (QEMU's l1_size)
  std::vector<uint32_t> gd;  // the entries inside the file; the rest read as 0
  TableCache* cache = nullptr;  // the grain-table windows of `file`
  // For info:
  std::string type, filename;
};

// What every extent of one host file shares.
struct HostFileState {
  std::unique_ptr<io::HostFile> owned;
  io::HostFile* file = nullptr;
  std::unique_ptr<TableCache> cache;  // grain tables, in kSlice windows of the file
  uint64_t tail_slice = 0;            // the window that crosses the end of the file
  std::vector<std::byte> tail_bytes;  // its bytes, zero-padded (empty: none)
};


// The map over `extents` (sorted, consecutive, non-empty); `files` hold the
// caches the extents point at (their HostFiles outlive the map).
std::unique_ptr<ExtentMap> make_map(std::string path, std::vector<VExtent> extents,
                                    std::vector<HostFileState> files);

}  // namespace qcowfs::image::vmdk
