// qcow2 consistency check and repair (`qcowfs check`), following QEMU's
// qcow2_check_refcounts(): every cluster the metadata references (header, L1
// and L2 tables of the active image and of every snapshot, data and compressed
// clusters, the snapshot table, the refcount table and blocks, the bitmap
// directory, bitmap tables and bitmap data) is counted in memory, and the
// counts are compared with the refcounts stored in the image:
//   stored > counted  -> a leak (wasted space, no harm to data)
//   stored < counted  -> a corruption (a cluster could be reused while in use)
// Entries pointing past the end of the file, misaligned tables and data
// clusters, invalid subcluster bitmaps, broken refcount table entries and
// wrong OFLAG_COPIED flags in the active tables are corruptions too.
//
// Repair: both modes lower leaked refcounts in place and fix OFLAG_COPIED
// flags (as qemu-img check -r leaks does too); RepairMode::all also, when any
// refcount is too low or the refcount structure itself is broken, writes a
// fresh refcount table and
// fresh refcount blocks after the last used cluster and switches the header
// to them in one write (rebuild_refcounts()).
//
// Implementation: check_walk.h counts the references, check_repair.h
// compares and repairs, qcow2_check.cc runs the passes and builds the report.
//
// Thread-safety: a check owns the HostFile it is given for its duration; no
// other writer may use the image meanwhile. All I/O goes through the calling
// thread's Engine.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "image/check.h"
#include "image/qcow2/header.h"
#include "io/host_file.h"
#include "io/status.h"
#include "io/task.h"

namespace qcowfs::image::qcow2 {

struct Bitmap;  // image/qcow2/qcow2_inspect.h

using image::CheckOptions;
using image::CheckReport;
using image::RepairMode;

// Checks (and with opts.repair, repairs) the qcow2 image in `file` (opened
// writable when repairing). A Status error means the check could not be done
// at all (unreadable or unparseable header); problems found inside the image
// are counted in the report, and I/O failures half-way are check_errors.
// With a repair mode, the report describes the image after the repair (as
// `qemu-img check -r` does after its "double checking" pass), plus the
// *_fixed counters.
Task<Result<CheckReport>> check_image(io::HostFile& file, CheckOptions opts);

// Recomputes every refcount from a walk of all metadata (active and snapshot
// L1/L2 tables, snapshot table, bitmaps, header) and writes a new refcount
// table and new refcount blocks at the end of the file (cluster aligned, past
// every referenced cluster), flushes, then points the header at them with one
// header write and flushes again. The old refcount structures become free
// space. `h` is updated in memory (refcount_table_offset and
// refcount_table_clusters). For the write path: call it on a dirty image
// opened read-write before any refcount is cached; it does not touch the
// dirty bit.
// on_corruption says what happens when the walk finds corrupt metadata (a
// table or cluster past the end of the file, misaligned, ...): rebuild anyway,
// as qemu-img check -r all does, or refuse with EIO before writing anything
// (the write path: such an image could have a cluster in use handed out again).
enum class OnCorruption { rebuild, refuse };
Task<Status> rebuild_refcounts(io::HostFile& file, Header& h, OnCorruption on_corruption = OnCorruption::rebuild);

// A byte range of the image file that metadata references.
struct HostRange {
  uint64_t offset = 0;
  uint64_t length = 0;
};

// The ranges one persistent bitmap references: its bitmap table and the data
// clusters the table names.
Task<Result<std::vector<HostRange>>> bitmap_ranges(io::HostFile& file, const Header& h, const Bitmap& b);

// Everything the bitmaps extension references, as QEMU's
// qcow2_check_bitmaps_refcounts() counts it: the bitmap directory and every
// bitmap's ranges. Empty without the extension or when its autoclear bit is
// clear (QEMU then ignores the extension, so those clusters are leaks).
Task<Result<std::vector<HostRange>>> bitmaps_extension_ranges(io::HostFile& file, const Header& h);

}  // namespace qcowfs::image::qcow2
