// Internal snapshots: what `qcowfs snapshot -l|-c|-a|-d` (tools/snapshot.cc)
// asks of a format, format-neutral, with QEMU's QEMUSnapshotInfo fields so the
// listing and the messages are qemu-img snapshot's. A format with internal
// snapshots (qcow2) offers the registry (image/format.h) a SnapshotOps; for
// the others tools/ answers as qemu-img does for a driver without snapshots.
//
// The operations work on an image file nobody else writes meanwhile (the
// caller holds QEMU's write lock, or for list at least the shared read lock).
// Each one writes in an order that leaves a crash with a consistent or merely
// leaky image (image/qcow2/DESIGN.md, "Snapshot write ordering").
//
// Thread-safety: the functions own the HostFile they are given for their
// duration; all I/O goes through the calling thread's Engine.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "image/block_driver.h"
#include "io/host_file.h"
#include "io/status.h"
#include "io/task.h"

namespace qcowfs::image {

// One internal snapshot as the listing shows it: what a driver reports for
// its snapshots (image/block_driver.h) plus QEMU's instruction count, absent
// when the entry records none.
struct SnapshotEntry {
  SnapshotInfo info;
  std::optional<uint64_t> icount;
};

// What a new snapshot is made of (qemu-img snapshot -c: a name and the time).
struct NewSnapshot {
  std::string name;
  uint32_t date_sec = 0;
  uint32_t date_nsec = 0;
};

// Errors carry the errno QEMU's driver returns (ENOTSUP, ENOENT, EFBIG, EIO
// for corrupt metadata, ...) and a message saying what was wrong; nothing is
// written before the checks and the in-memory walk succeeded.
struct SnapshotOps {
  // The snapshot table in table order (empty when there is none).
  Task<Result<std::vector<SnapshotEntry>>> (*list)(io::HostFile& file);
  // Takes a snapshot of the active disk; returns it with its new id.
  Task<Result<SnapshotEntry>> (*create)(io::HostFile& file, NewSnapshot snapshot);
  // Makes snapshot `id_or_name` (looked up by id first, then by name) the
  // active disk, its size included. EBUSY: refused as QEMU's generic layer
  // refuses it (the message is the whole reason, e.g. "Device has active
  // dirty bitmaps"); other errors are the driver's ("Failed to load snapshot").
  Task<Status> (*apply)(io::HostFile& file, std::string id_or_name);
  // Deletes the snapshot with this id and this name (QEMU's
  // find_snapshot_by_id_and_name()) and frees what only it used.
  Task<Status> (*remove)(io::HostFile& file, std::string id, std::string name);
};

}  // namespace qcowfs::image
