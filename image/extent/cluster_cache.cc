#include "image/extent/cluster_cache.h"

#include <algorithm>

namespace qcowfs::image {

size_t ClusterCache::default_capacity(uint64_t cluster_size) {
  // A decompressed cluster occupies at least one page (AlignedBuffer).
  return static_cast<size_t>(std::max<uint64_t>(2, (4ull << 20) / std::max<uint64_t>(cluster_size, io::kMinMemAlign)));
}

ClusterCache::Cluster ClusterCache::find(uint64_t host_offset) {
  std::lock_guard lk(mu_);
  auto it = map_.find(host_offset);
  if (it == map_.end()) return nullptr;
  lru_.splice(lru_.begin(), lru_, it->second.second);
  return it->second.first;
}

void ClusterCache::insert(uint64_t host_offset, Cluster c) {
  std::lock_guard lk(mu_);
  if (map_.count(host_offset)) return;
  while (map_.size() >= capacity_) {
    map_.erase(lru_.back());
    lru_.pop_back();
  }
  lru_.push_front(host_offset);
  map_.emplace(host_offset, std::make_pair(std::move(c), lru_.begin()));
}

void ClusterCache::erase(uint64_t host_offset) {
  std::lock_guard lk(mu_);
  auto it = map_.find(host_offset);
  if (it == map_.end()) return;
  lru_.erase(it->second.second);
  map_.erase(it);
}

size_t ClusterCache::size() const {
  std::lock_guard lk(mu_);
  return map_.size();
}

}  // namespace qcowfs::image
