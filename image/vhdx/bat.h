// The VHDX block allocation table: QEMU's open-time check of its entries
// (vhdx_check_bat_entries) and the ExtentMap that turns guest offsets into
// extents with QEMU's reading rules (vhdx_co_readv):
//   NOT_PRESENT, UNDEFINED, ZERO, UNMAPPED (3 and the pre-1.0 value 5)  zeros
//   FULLY_PRESENT                                    data at the entry's MiB offset
//   PARTIALLY_PRESENT (differencing disks), 4        EIO
// The BAT is read through a TableCache of 4 KiB slices (512 entries); the
// slice that the end of the file cuts is kept in memory, entries past the end
// of the file are zero (NOT_PRESENT), as QEMU reads them.
// Thread-safety: BatMap as ExtentMap (try_map() from any thread; the cache is
// thread-safe and the rest is immutable after init()). check_bat() is a plain
// coroutine over its own buffer.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "image/extent/driver.h"
#include "image/extent/table_cache.h"
#include "image/vhdx/header.h"

namespace qcowfs::image::vhdx {

// Refuses (EINVAL) what QEMU's open refuses: a FULLY_PRESENT entry that starts
// or ends past the end of the file or whose offset overflows, and a payload
// block overlapping the log or a region (QEMU's count of payload entries,
// which counts only FULLY_PRESENT ones, included).
Task<Status> check_bat(io::HostFile& file, const Geometry& g, const Regions& regions, const std::string& path);

// Calls fn for every FULLY_PRESENT entry in BAT order (entries past the end
// of the file read as NOT_PRESENT), with whether QEMU's running count takes it
// for a payload block; stops at the first error fn returns.
Task<Status> for_each_present(io::HostFile& file, const Geometry& g, const Regions& regions, const std::string& path,
                              const std::function<Status(uint64_t i, uint64_t entry, bool payload)>& fn);

// What a read-write open adds: every FULLY_PRESENT block (payload and sector
// bitmap) at or past 1 MiB, overlapping no other block, the log or a region;
// no PARTIALLY_PRESENT or invalid (4) state. EIO (mount it read-only)
// otherwise. Returns where new blocks go: past the end of the file, of every
// block, of the log and of every region, rounded up to 1 MiB.
Task<Result<uint64_t>> check_bat_writable(io::HostFile& file, const Geometry& g, const Regions& regions,
                                          const std::string& path);

class BatMap final : public ExtentMap {
 public:
  // file outlives the map; cache_bytes 0 picks the default.
  BatMap(io::HostFile& file, const Geometry& g, uint64_t bat_offset, std::string path, uint64_t cache_bytes);
  // Reads the slice that the end of the file cuts, if any.
  Task<Status> init();

  Result<std::optional<Extent>> try_map(uint64_t guest, uint64_t len) override;
  Task<Result<Extent>> map(uint64_t guest, uint64_t len) override;

  // Write side (VhdxWriter; the whole BAT is inside the file): the cache, the
  // host offset of the slice holding BAT index `index` and the entry's byte in
  // it, and atomic access to entries in a slice.
  TableCache& cache() { return cache_; }
  uint64_t slice_host(uint64_t index) const;
  static size_t offset_in_slice(uint64_t index);
  static uint64_t load_entry(const TableCache::Ref& slice, size_t at);
  static void store_entry(TableCache::Ref& slice, size_t at, uint64_t entry);

 private:
  enum class Where { cache, tail, past_eof };
  Where where(uint64_t index) const;
  // The entry if it is in memory (the cache, the tail, or past the end of the file).
  std::optional<uint64_t> entry_in_memory(uint64_t index);
  Result<Extent> classify(uint64_t entry, uint64_t guest, uint64_t len) const;
  Result<Extent> extend(Extent first, uint64_t guest, uint64_t len);

  io::HostFile& file_;
  const Geometry g_;
  const uint64_t bat_offset_;
  const std::string path_;
  const uint64_t file_size_;
  TableCache cache_;
  std::vector<std::byte> tail_;  // the slice cut by the end of the file, zero-padded
};

}  // namespace qcowfs::image::vhdx
