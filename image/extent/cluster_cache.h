// ClusterCache: a small LRU cache of decompressed clusters (qcow2's
// compressed clusters, VMDK's compressed grains), keyed by the host offset of
// their compressed stream, so a run of small reads inside one compressed
// cluster decompresses it once.
// Thread-safety: thread-safe (one internal mutex, never held across a suspension).
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "io/buffer.h"

namespace qcowfs::image {

// Decompressed clusters keyed by the host offset of their compressed stream.
class ClusterCache {
 public:
  using Cluster = std::shared_ptr<const io::AlignedBuffer>;
  explicit ClusterCache(size_t capacity) : capacity_(capacity == 0 ? 1 : capacity) {}
  // Capacity for a cluster size: 4 MiB worth, at least two clusters.
  static size_t default_capacity(uint64_t cluster_size);

  Cluster find(uint64_t host_offset);
  void insert(uint64_t host_offset, Cluster c);
  // Forgets the cluster whose stream starts at host_offset (its bytes are being reused).
  void erase(uint64_t host_offset);
  size_t size() const;

 private:
  const size_t capacity_;
  mutable std::mutex mu_;  // guards map_ and lru_
  std::list<uint64_t> lru_;  // front = most recently used
  std::unordered_map<uint64_t, std::pair<Cluster, std::list<uint64_t>::iterator>> map_;
};

}  // namespace qcowfs::image
