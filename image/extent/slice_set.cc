#include "image/extent/slice_set.h"

#include <string>

namespace qcowfs::image {

Task<Status> SliceSet::pin(TableCache& cache, uint64_t slice, std::string_view what) {
  const Key k{&cache, slice};
  if (pinned_.count(k) || dirty_.count(k)) co_return Status::ok();
  auto ref = co_await cache.get(slice);
  if (!ref) co_return ref.status().with_context(fmt::format("reading {}", what));
  pinned_.emplace(k, std::move(*ref));
  co_return Status::ok();
}

TableCache::Ref& SliceSet::change(TableCache& cache, uint64_t slice) {
  const Key k{&cache, slice};
  auto dirty = dirty_.find(k);
  if (dirty != dirty_.end()) return dirty->second;
  auto pinned = pinned_.find(k);
  dirty = dirty_.emplace(k, std::move(pinned->second)).first;
  pinned_.erase(pinned);
  return dirty->second;
}

Task<Status> SliceSet::write_dirty() {
  while (!dirty_.empty()) {
    auto it = dirty_.begin();
    QCOWFS_CO_TRY(co_await it->first.first->file().write(it->first.second, it->second.bytes()));
    dirty_.erase(it);
  }
  co_return Status::ok();
}

}  // namespace qcowfs::image
