// SnapshotDirectory: DIR/snapshots/ in directory mode, one <name>.raw (or
// snapshot-<id>.raw, inode_table.h snapshot_file_name()) per internal
// snapshot of the disk, each a read-only view opened on its first open
// (BlockDriver::open_snapshot) and counted while open (ImageFile::acquire /
// release, as a catalogue image).
//
// The listing is the driver's snapshot table as it is now
// (BlockDriver::snapshots(), in memory): re-read on every opendir and before
// every lookup, so what a live `qcowfs snapshot -c` / `-d` (fuse/live_snapshot.h)
// changed shows at the next listing or path walk. A snapshot whose id, name,
// size and file name are unchanged keeps its inode; entries are given with no
// entry timeout (a dynamic directory), so a deleted one is ENOENT at once.
//
// release_view(id) is the live -d's check, made while the disk is paused: a
// view of that snapshot held open is EBUSY (as QEMU's reader's lock makes
// `qemu-img snapshot -d` fail); one opened before but now unused is closed, so
// nothing reads the snapshot's clusters once they are freed.
//
// Thread-safety: every method may be called concurrently from any event-loop
// thread; one mutex guards the entries. Nodes are never freed before the
// directory, so a request holding one stays safe across refreshes.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "fuse/inode_table.h"

namespace qcowfs::fuse {

// Snapshot inodes start here, above the partitions' (a catalogue has neither).
constexpr Ino kSnapshotInoBase = Ino{3} << 32;

class SnapshotDirectory final : public DynamicDirectory {
 public:
  // disk is borrowed and must outlive the directory's views.
  SnapshotDirectory(Ino dir, image::BlockDriver* disk);

  bool has_directory(Ino dir) const override { return dir == dir_; }
  const Node* get(Ino ino) const override;
  const Node* lookup(Ino dir, std::string_view name) const override;
  std::vector<Ino> children(Ino dir) const override;
  std::vector<ImageFile*> image_files() const override;
  Task<Status> refresh(Ino dir) override;
  bool needs_refresh(Ino) const override { return true; }  // an in-memory table: cheap
  std::string_view source() const override { return "the snapshot table"; }

  // Closes the views of snapshot `id` that nobody holds open; EBUSY when one
  // is open.
  Task<Status> release_view(std::string id);
  // Re-reads the listing from the driver now (what refresh() does).
  void reread();

 private:
  struct Entry {
    image::SnapshotInfo info;
    Node node;
  };
  Entry* find_or_make(const image::SnapshotInfo& s, std::string name);  // mu_ held

  const Ino dir_;
  image::BlockDriver* const disk_;
  mutable std::mutex mu_;  // guards everything below
  std::map<Ino, std::unique_ptr<Entry>> all_;  // every entry ever made, by inode
  std::vector<Entry*> current_;                // the listing, in the table's order
  Ino next_ino_ = kSnapshotInoBase;
};

// Adds DIR/snapshots/ under the root for `disk` (borrowed, must outlive the
// table) when it has snapshots now, or always when `may_change` (a live mount
// of a format with internal snapshots: a live -c may add the first one). The
// SnapshotDirectory is returned for the control socket (owned by the table),
// nullptr when there is no directory.
SnapshotDirectory* add_snapshot_directory(InodeTable& table, image::BlockDriver& disk, bool may_change);

}  // namespace qcowfs::fuse
