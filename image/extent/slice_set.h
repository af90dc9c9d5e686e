// SliceSet: the metadata table slices an ExtentWriter changes (QED's L2
// tables, VMDK's grain tables, the VHDX BAT), kept in their TableCaches.
// prepare() pins the slices a request will change (loaded, so that publish()
// cannot fail); the first change of a pinned slice moves it to the dirty set,
// which keeps it pinned until write_metadata() has written it. Slices are keyed
// by their cache (one per host file) and host offset; the dirty set is
// ordered, so write-back goes in file order.
// Thread-safety: none; a writer's calls are serialised by ExtentDriver's
// allocation lock.
#pragma once

#include <cstdint>
#include <map>
#include <string_view>
#include <utility>

#include "image/extent/table_cache.h"
#include "io/status.h"
#include "io/task.h"

namespace qcowfs::image {

class SliceSet {
 public:
  using Key = std::pair<TableCache*, uint64_t>;  // the cache and the slice's host offset

  // Loads and pins the slice at host offset `slice` of `cache` (nothing when
  // it is pinned or dirty already); `what` names the table in an error.
  Task<Status> pin(TableCache& cache, uint64_t slice, std::string_view what);
  // The slice, pinned or dirty, now dirty (pin() first).
  TableCache::Ref& change(TableCache& cache, uint64_t slice);
  // Drops the pins of requests that failed before publishing (call only
  // when no allocation is in flight).
  void release_pins() { pinned_.clear(); }
  bool dirty() const { return !dirty_.empty(); }
  // The dirty slices, in file order: write them, then erase() what was written.
  const std::map<Key, TableCache::Ref>& dirty_slices() const { return dirty_; }
  void erase(const Key& k) { dirty_.erase(k); }
  // Writes every dirty slice to its cache's file, one host write each.
  Task<Status> write_dirty();

 private:
  std::map<Key, TableCache::Ref> pinned_;
  std::map<Key, TableCache::Ref> dirty_;
};

}  // namespace qcowfs::image
