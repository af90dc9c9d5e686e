// PartitionDirectory: DIR/partitions/ in directory mode, one pN.raw per
// partition of the disk (image/views/partition.h numbering), each a WindowDriver
// onto the main driver with the disk's access mode. The table is re-read on
// every opendir of the directory, and on a lookup once a write through the
// mount (the view or any partition) has touched what the table was read from
// or the first kWatchedHead bytes of the disk, so `sfdisk` then `mkfs` on a new
// partition works without listing the directory first. A partition whose
// number, offset and size are unchanged keeps its inode; a changed one gets a
// new inode (no stale sizes in the kernel's attribute cache for the old one),
// and entries are given to the kernel with no entry timeout, so every path
// walk asks again.
// Thread-safety: all methods may be called concurrently from any event-loop
// thread (the entries as fuse/listed_dir.h keeps them).
// note_write() takes no lock: it reads the watched ranges through an atomic
// pointer to an immutable list (every list ever made is kept until the
// directory is destroyed; a new one is made only when the table's ranges change).
#pragma once

#include <atomic>
#include <memory>
#include <vector>

#include "fuse/listed_dir.h"
#include "image/views/partition.h"
#include "image/views/window.h"
#include "io/engine.h"

namespace qcowfs::fuse {

// Partition inodes start here, far above the dense static ones.
constexpr Ino kPartitionInoBase = Ino{1} << 32;

// A write to the disk's first bytes always marks the table stale: they hold
// the MBR and, for 512- and 4096-byte sectors, the primary GPT.
constexpr uint64_t kWatchedHead = 64 * 1024;

struct PartitionEntry {
  image::Partition partition;
  std::unique_ptr<image::WindowDriver> window;
  Node node;
};

class PartitionDirectory final : public ListedDirectory<PartitionEntry>, public WriteWatch {
 public:
  // disk is borrowed and must outlive the directory.
  PartitionDirectory(Ino dir, image::BlockDriver* disk, bool writable);

  Task<Status> refresh(Ino dir) override;
  bool needs_refresh(Ino) const override { return stale_.load(std::memory_order_acquire); }
  std::string_view source() const override { return "the partition table"; }
  void note_write(uint64_t disk_offset, uint64_t len) override;

 private:
  using Ranges = std::vector<image::DiskRange>;
  bool watched(uint64_t disk_offset, uint64_t len) const;
  void set_watched(Ranges ranges);  // mu_ held

  PartitionEntry* find_or_make(const image::Partition& p);  // mu_ held

  image::BlockDriver* const disk_;
  const bool writable_;
  // Every list made, the last is current; guarded by mu_ (ListedDirectory's).
  std::vector<std::unique_ptr<const Ranges>> watched_lists_;
  std::atomic<const Ranges*> watched_{nullptr};  // sorted by offset; nullptr: only the head
  std::atomic<bool> stale_{false};
};

// Adds DIR/partitions/ under the root for the disk behind `disk_view` (the
// main view, opened; borrowed, must outlive the table), with its access mode,
// watching its writes; reads the table once now on `engine` (a table that
// cannot be read leaves it empty until the next opendir or lookup).
void add_partition_directory(InodeTable& table, ImageFile& disk_view, io::Engine& engine);

}  // namespace qcowfs::fuse
