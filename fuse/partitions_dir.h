// PartitionDirectory: DIR/partitions/ in directory mode, one pN.raw per
// partition of the disk (image/partition.h numbering), each a WindowDriver
// onto the main driver with the disk's access mode. The table is re-read on
// every opendir of the directory, so the listing follows partitioning done
// through the mount. A partition whose number, offset and size are unchanged
// keeps its inode; a changed one gets a new inode (no stale sizes in the
// kernel's attribute cache for the old one).
// Thread-safety: all methods may be called concurrently from any event-loop
// thread; one mutex guards the entries. Nodes are never freed before the
// directory, so a request holding one stays safe across refreshes.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "fuse/inode_table.h"
#include "image/partition.h"
#include "image/window.h"
#include "io/engine.h"

namespace qcowfs::fuse {

// Partition inodes start here, far above the dense static ones.
constexpr Ino kPartitionInoBase = Ino{1} << 32;

class PartitionDirectory final : public DynamicDirectory {
 public:
  // disk is borrowed and must outlive the directory.
  PartitionDirectory(Ino dir, image::BlockDriver* disk, bool writable);

  const Node* get(Ino ino) const override;
  const Node* lookup(std::string_view name) const override;
  std::vector<Ino> children() const override;
  std::vector<ImageFile*> image_files() const override;
  Task<Status> refresh() override;

 private:
  struct Entry {
    image::Partition partition;
    std::unique_ptr<image::WindowDriver> window;
    Node node;
  };
  Entry* find_or_make(const image::Partition& p);  // mu_ held

  const Ino dir_;
  image::BlockDriver* const disk_;
  const bool writable_;
  mutable std::mutex mu_;  // guards everything below
  std::map<Ino, std::unique_ptr<Entry>> all_;  // every entry ever made, by inode
  std::vector<Entry*> current_;                // the listing, by partition number
  Ino next_ino_ = kPartitionInoBase;
};

// Adds DIR/partitions/ under the root, reading the table once now on `engine`
// (a table that cannot be read leaves it empty until the next opendir).
void add_partition_directory(InodeTable& table, image::BlockDriver& disk, bool writable, io::Engine& engine);

}  // namespace qcowfs::fuse
