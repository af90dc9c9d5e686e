// QedMap: the ExtentMap of a QED image. The L1 table (the entries that map
// the virtual size) is read at open and never changes; L2 tables are read in
// 4 KiB slices through a TableCache. Entries are classified the way QEMU's
// qed_find_cluster() and qed_count_contiguous_clusters() do: 0 unallocated
// (the backing file's bytes, else zeros), 1 a zero cluster, anything else a
// data cluster that must be a valid cluster offset (else EIO).
// Thread-safety: try_map() and map() may run concurrently on any thread; the
// L1 table is immutable and the TableCache is thread-safe. The host file must
// outlive the map.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "image/extent_driver.h"
#include "image/qed/header.h"
#include "image/table_cache.h"

namespace qcowfs::image::qed {

class QedMap final : public ExtentMap {
 public:
  // l1: the first header.l1_entries() entries of the L1 table, host order.
  // cache_bytes: the L2 cache size (0: the default for the disk).
  QedMap(io::HostFile& file, std::string path, const Header& header, std::vector<uint64_t> l1,
         uint64_t cache_bytes);

  Result<std::optional<Extent>> try_map(uint64_t guest, uint64_t len) override;
  Task<Result<Extent>> map(uint64_t guest, uint64_t len) override;

  TableCache& cache() { return cache_; }

 private:
  // Where guest's L2 entry is: its slice's host offset and its byte offset in it.
  struct EntryAt {
    uint64_t slice = 0;
    size_t at = 0;
  };
  // The L2 table of guest, or an unallocated extent (l2 == 0), or EIO.
  Result<uint64_t> l2_table(uint64_t guest) const;
  Extent unallocated_l1_run(uint64_t guest, uint64_t len) const;
  EntryAt entry_at(uint64_t l2, uint64_t guest) const;
  Result<Extent> scan(const TableCache::Ref& slice, size_t at, uint64_t guest, uint64_t len) const;
  Status bad_entry(uint64_t entry, uint64_t guest) const;

  io::HostFile& file_;
  std::string path_;
  Header h_;
  std::vector<uint64_t> l1_;
  TableCache cache_;
};

}  // namespace qcowfs::image::qed
