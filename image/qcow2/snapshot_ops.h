// qcow2 internal snapshots: create, apply (goto) and delete as QEMU 7.2's
// block/qcow2-snapshot.c does them, on a SnapshotImage
// (image/qcow2/snapshot_image.h); the registry's SnapshotOps that open one on
// a file for `qcowfs snapshot` are declared in image/qcow2/qcow2_snapshot.h.
//
//   create  the active L1 table copied to new clusters, every cluster it
//           reaches one reference more, OFLAG_COPIED cleared where the
//           refcount is no longer 1, the entry appended (next numeric ID,
//           vm_state_size 0, the disk size, icount 0 as qemu-img writes).
//   apply   the snapshot's L1 becomes the active one (the active table grows
//           in new clusters if the snapshot's is larger; the disk size is the
//           snapshot's): its clusters one reference more, the old active
//           table's one less, then COPIED set where the refcount is 1.
//   delete  the entry removed from the table, its clusters one reference
//           less (freed clusters discarded, as QEMU's pass-discard-snapshot),
//           its L1 table freed, COPIED set again where the refcount is 1.
//
// Images with an external data file are refused with ENOTSUP, as QEMU does.
// Thread-safety: as SnapshotImage.
#pragma once

#include <string>

#include "image/qcow2/snapshot_image.h"
#include "image/snapshot.h"
#include "io/status.h"
#include "io/task.h"

namespace qcowfs::image::qcow2 {

Task<Result<Snapshot>> create_snapshot(SnapshotImage& im, NewSnapshot request);
Task<Status> apply_snapshot(SnapshotImage& im, std::string id_or_name);
Task<Status> delete_snapshot(SnapshotImage& im, std::string id, std::string name);

}  // namespace qcowfs::image::qcow2
