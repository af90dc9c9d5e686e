// The ExtentMap of a Parallels image: the BAT in memory (the entries that lie
// inside the file; QEMU reads the rest as zeros, i.e. unallocated). Cluster i
// is at bat[i] * off_multiplier sectors; clusters that follow each other on
// the host are one extent, as QEMU's block_status() merges them. Unallocated
// clusters are ExtentKind::unallocated ("present": false). A cluster that
// starts at or past the end of the file is EIO (QEMU would read zeros).
// Entries change only through publish() (ParallelsWriter, for clusters it
// allocated).
// Thread-safety: try_map() may run concurrently on any thread with one
// publish() at a time (entries are atomic).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "image/extent/driver.h"

namespace qcowfs::image::parallels {

class ClusterMap final : public ExtentMap {
 public:
  ClusterMap(io::HostFile* file, std::string path, uint64_t cluster_size, uint64_t off_multiplier,
             std::vector<uint32_t> bat);
  Result<std::optional<Extent>> try_map(uint64_t guest, uint64_t len) override;
  // The BAT entry of cluster (0 past the entries kept: unallocated).
  uint32_t entry(uint64_t cluster) const;
  // Cluster (< entries()) now starts at BAT unit `entry` (allocated, written, not yet on disk).
  void publish(uint64_t cluster, uint32_t entry);
  uint64_t entries() const { return bat_.size(); }

 private:
  uint64_t host(uint64_t cluster) const { return uint64_t{entry(cluster)} * unit_; }
  Result<Extent> data_extent(uint64_t guest, uint64_t len) const;

  io::HostFile* file_;
  std::string path_;
  uint64_t cluster_size_;
  uint64_t unit_;  // bytes a BAT unit
  std::vector<uint32_t> bat_;
};

}  // namespace qcowfs::image::parallels
