// Compressed qcow2 clusters: decompression of one cluster (raw deflate with a
// 4 KiB window, or zstd) and a small LRU cache of decompressed clusters.
// decompress_cluster() is CPU work: the driver runs it through io::offload.
// Thread-safety: decompress_cluster() is a pure function; ClusterCache is
// thread-safe (one internal mutex, never held across a suspension).
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <span>
#include <unordered_map>

#include "io/buffer.h"
#include "io/status.h"

namespace qcowfs::image::qcow2 {

// Fills all of `out` (one cluster) from the compressed stream `in`, stopping
// once the cluster is full. `in` may carry trailing bytes of the next stream.
// EIO when the stream is corrupt or ends before the cluster is full.
Status decompress_cluster(uint8_t compression_type, std::span<const std::byte> in, std::span<std::byte> out);

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

}  // namespace qcowfs::image::qcow2
