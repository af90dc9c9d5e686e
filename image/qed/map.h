// QedMap: the ExtentMap of a QED image. The L1 table (the entries that map
// the virtual size) is read at open and never changes; L2 tables are read in
// 4 KiB slices through a TableCache. Entries are classified the way QEMU's
// qed_find_cluster() and qed_count_contiguous_clusters() do: 0 unallocated
// (the backing file's bytes, else zeros), 1 a zero cluster, anything else a
// data cluster that must be a valid cluster offset (else EIO).
// On a read-write open QedWriter changes L1 entries, L2 entries (in pinned
// cache slices) and the file's size as validation sees it (grow_file).
// Thread-safety: try_map() and map() may run concurrently on any thread with
// one writer call at a time: entries are read and written atomically, the
// TableCache is thread-safe. The host file must outlive the map.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "image/extent/driver.h"
#include "image/qed/header.h"
#include "image/extent/table_cache.h"

namespace qcowfs::image::qed {

class QedMap final : public ExtentMap {
 public:
  // l1: the first header.l1_entries() entries of the L1 table, host order.
  // cache_bytes: the L2 cache size (0: the default for the disk).
  QedMap(io::HostFile& file, std::string path, const Header& header, std::vector<uint64_t> l1, uint64_t cache_bytes);

  Result<std::optional<Extent>> try_map(uint64_t guest, uint64_t len) override;
  Task<Result<Extent>> map(uint64_t guest, uint64_t len) override;

  TableCache& cache() { return cache_; }

  // Where guest's L2 entry is: its slice's host offset and its byte offset in it.
  struct EntryAt {
    uint64_t slice = 0;
    size_t at = 0;
  };
  EntryAt entry_at(uint64_t l2, uint64_t guest) const;
  // L1 entry i (< l1_entries()).
  uint64_t l1_entry(uint64_t i) const;
  void set_l1_entry(uint64_t i, uint64_t l2);
  uint64_t l1_entries() const { return l1_.size(); }
  // An L2 entry in a slice, atomically (little-endian on disk).
  static uint64_t load_entry(const TableCache::Ref& slice, size_t at);
  static void store_entry(TableCache::Ref& slice, size_t at, uint64_t entry);
  // Host bytes [0, end) now hold clusters and tables the map may name.
  void grow_file(uint64_t end);
  const Header& header() const { return h_; }

 private:
  // The L2 table of guest, or an unallocated extent (l2 == 0), or EIO.
  Result<uint64_t> l2_table(uint64_t guest) const;
  Extent unallocated_l1_run(uint64_t guest, uint64_t len) const;
  Result<Extent> scan(const TableCache::Ref& slice, size_t at, uint64_t guest, uint64_t len) const;
  Status bad_entry(uint64_t entry, uint64_t guest) const;

  io::HostFile& file_;
  std::string path_;
  Header h_;
  std::vector<uint64_t> l1_;
  std::atomic<uint64_t> file_size_;  // bytes offsets are checked against
  TableCache cache_;
};

}  // namespace qcowfs::image::qed
