#include "image/parallels/map.h"

#include <algorithm>
#include <atomic>

#include "image/parallels/format.h"
#include "io/log.h"

namespace qcowfs::image::parallels {

ClusterMap::ClusterMap(io::HostFile* file, std::string path, uint64_t cluster_size, uint64_t off_multiplier,
                       std::vector<uint32_t> bat)
    : file_(file),
      path_(std::move(path)),
      cluster_size_(cluster_size),
      unit_(off_multiplier * kSector),
      bat_(std::move(bat)) {}

// Entries are read while ParallelsWriter publishes new ones from another thread.
uint32_t ClusterMap::entry(uint64_t cluster) const {
  if (cluster >= bat_.size()) return 0;
  return std::atomic_ref<uint32_t>(const_cast<uint32_t&>(bat_[cluster])).load(std::memory_order_acquire);
}

void ClusterMap::publish(uint64_t cluster, uint32_t entry) {
  std::atomic_ref<uint32_t>(bat_[cluster]).store(entry, std::memory_order_release);
}

Result<std::optional<Extent>> ClusterMap::try_map(uint64_t guest, uint64_t len) {
  uint64_t cluster = guest / cluster_size_;
  if (entry(cluster) != 0) {
    auto e = data_extent(guest, len);
    if (!e) return e.status();
    return std::optional<Extent>(*e);
  }
  Extent e;
  e.kind = ExtentKind::unallocated;
  e.length = std::min(len, cluster_size_ - guest % cluster_size_);
  while (e.length < len && entry(++cluster) == 0) {
    if (cluster >= bat_.size()) {
      e.length = len;  // nothing past the BAT's last in-file entry is allocated
      break;
    }
    e.length = std::min(len, e.length + cluster_size_);
  }
  return std::optional<Extent>(e);
}

// The run of host-contiguous clusters from guest; EIO for a cluster that
// starts past the end of the file.
Result<Extent> ClusterMap::data_extent(uint64_t guest, uint64_t len) const {
  uint64_t cluster = guest / cluster_size_;
  const uint64_t start = host(cluster);
  if (start >= file_->size()) {
    log::error("{}: corrupt Parallels BAT entry {} for guest offset {:#x}: cluster at {:#x}, beyond the file end",
               path_, cluster, guest, start);
    return Status::errorf(EIO, "{}: corrupt Parallels BAT entry {} for guest offset {:#x}: beyond the end of the file",
                          path_, cluster, guest);
  }
  Extent e;
  e.kind = ExtentKind::data;
  e.file = file_;
  e.host_offset = start + guest % cluster_size_;
  e.length = std::min(len, cluster_size_ - guest % cluster_size_);
  while (e.length < len && entry(cluster + 1) != 0 && host(cluster + 1) == host(cluster) + cluster_size_ &&
         host(cluster + 1) < file_->size()) {
    ++cluster;
    e.length = std::min(len, e.length + cluster_size_);
  }
  return e;
}

}  // namespace qcowfs::image::parallels
