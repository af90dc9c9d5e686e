// qcow2's internal snapshots for the format registry: the SnapshotOps
// (image/snapshot.h) behind `qcowfs snapshot`, implemented in
// image/qcow2/snapshot_ops.cc.
// Thread-safety: an immutable table of functions.
#pragma once

#include "image/snapshot.h"

namespace qcowfs::image {

extern const SnapshotOps kQcow2SnapshotOps;

}  // namespace qcowfs::image
