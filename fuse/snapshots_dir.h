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
// thread (the entries as fuse/listed_dir.h keeps them).
#pragma once

#include <string>

#include "fuse/listed_dir.h"

namespace qcowfs::fuse {

// Snapshot inodes start here, above the partitions' (a catalogue has neither).
constexpr Ino kSnapshotInoBase = Ino{3} << 32;

struct SnapshotEntry {
  image::SnapshotInfo info;
  Node node;
};

class SnapshotDirectory final : public ListedDirectory<SnapshotEntry> {
 public:
  // disk is borrowed and must outlive the directory's views.
  SnapshotDirectory(Ino dir, image::BlockDriver* disk);

  Task<Status> refresh(Ino dir) override;
  bool needs_refresh(Ino) const override { return true; }  // an in-memory table: cheap
  std::string_view source() const override { return "the snapshot table"; }

  // Closes the views of snapshot `id` that nobody holds open; EBUSY when one
  // is open.
  Task<Status> release_view(std::string id);
  // Re-reads the listing from the driver now (what refresh() does).
  void reread();

 private:
  SnapshotEntry* find_or_make(const image::SnapshotInfo& s, std::string name);  // mu_ held

  image::BlockDriver* const disk_;
};

// Adds DIR/snapshots/ under the root for `disk` (borrowed, must outlive the
// table) when it has snapshots now, or always when `may_change` (a live mount
// of a format with internal snapshots: a live -c may add the first one). The
// SnapshotDirectory is returned for the control socket (owned by the table),
// nullptr when there is no directory.
SnapshotDirectory* add_snapshot_directory(InodeTable& table, image::BlockDriver& disk, bool may_change);

}  // namespace qcowfs::fuse
