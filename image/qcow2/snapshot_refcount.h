// The refcount walk of internal snapshots, QEMU's
// qcow2_update_snapshot_refcount() split in its two jobs so that each write
// can be ordered on its own (image/qcow2/DESIGN.md, "Snapshot write ordering"):
//
//   add_l1_refcounts()  adds delta (+1, -1; 0 only validates) to the refcount
//                       of every cluster an L1 table reaches: its L2 tables,
//                       their data clusters (also zero clusters that keep a
//                       host cluster) and the host clusters of compressed
//                       clusters. In memory only (SnapshotImage::refcounts);
//                       every entry is validated first (classify_l2_entry()),
//                       so a corrupt table fails before anything is written.
//   fix_copied_flags()  sets OFLAG_COPIED on the L2 entries and L1 entries of
//                       a table exactly where the refcount is 1 (never on
//                       compressed clusters), writes the L2 tables it changed
//                       and flushes; the L1 entries are fixed in the caller's
//                       vector, which the caller writes where it belongs.
//
// Thread-safety: as SnapshotImage.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "image/qcow2/snapshot_image.h"
#include "io/status.h"
#include "io/task.h"

namespace qcowfs::image::qcow2 {

Task<Status> add_l1_refcounts(SnapshotImage& im, std::span<const uint64_t> l1, int delta);

// Returns whether any L1 entry changed.
Task<Result<bool>> fix_copied_flags(SnapshotImage& im, std::vector<uint64_t>& l1);

}  // namespace qcowfs::image::qcow2
