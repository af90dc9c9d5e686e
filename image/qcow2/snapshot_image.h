// The state the internal-snapshot operations (image/qcow2/snapshot_ops.h) work
// on: a qcow2 image's header, active L1 table, snapshot table and refcounts,
// loaded from a file nobody else writes meanwhile, and the steps they are
// made of, each writing in the order image/qcow2/DESIGN.md ("Snapshot write
// ordering") states: refcount increases durable before anything references
// them, references dropped durably before the refcounts are lowered.
//
// Refcounts go through the writer's RefcountTable and ClusterAllocator
// (image/qcow2/refcount.h, alloc.h): changes stay in memory until
// write_refcounts() writes the dirty blocks (and new reftable entries) and
// flushes. A caller that already holds the image open (a read-write mount's
// daemon) quiesces it first: in-flight writes drained, its metadata written
// back and flushed, its L2 cache dropped afterwards (the operations rewrite
// L2 tables for the COPIED flags), then loads a SnapshotImage on the same file.
//
// Thread-safety: one coroutine owns a SnapshotImage and its file.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "image/qcow2/alloc.h"
#include "image/qcow2/header.h"
#include "image/qcow2/refcount.h"
#include "image/qcow2/snapshot.h"
#include "io/host_file.h"
#include "io/status.h"
#include "io/task.h"

namespace qcowfs::image::qcow2 {

struct SnapshotImage {
  explicit SnapshotImage(io::HostFile& f) : file(f) {}
  io::HostFile& file;
  Header header;
  std::vector<uint64_t> l1;  // the active L1 table's entries, as stored
  std::vector<Snapshot> snapshots;
  uint64_t snapshots_bytes = 0;  // the table's size on disk
  std::unique_ptr<RefcountTable> refcounts;
  std::unique_ptr<ClusterAllocator> alloc;
  // Clusters whose refcount fell to 0: discarded once that is on disk.
  std::vector<HostCluster> freed;

  uint64_t cluster_size() const { return header.cluster_size(); }
  uint64_t clusters_for(uint64_t bytes) const { return (bytes + cluster_size() - 1) >> header.cluster_bits; }
};

// Reads header, active L1, snapshot table and reftable of a qcow2 image
// opened writable. Refuses what QEMU would not write (check_features()); a
// dirty image (lazy refcounts) gets its refcounts rebuilt first, as QEMU's
// read-write open does, and its dirty bit cleared.
Task<Result<std::unique_ptr<SnapshotImage>>> load_snapshot_image(io::HostFile& file);

// An L1 table of `entries` entries at `offset` (bounds checked against the file).
Task<Result<std::vector<uint64_t>>> read_l1_table(io::HostFile& file, const Header& h, HostOffset offset,
                                                  uint32_t entries);
// Writes L1 entries at `offset`, zero-padded to `bytes` (>= 8 * entries).
Task<Status> write_l1_table(io::HostFile& file, HostOffset offset, std::span<const uint64_t> l1, uint64_t bytes);

// Reserves n contiguous clusters (refcount 1 in memory), growing the
// refcount table when needed; returns the first.
Task<Result<HostCluster>> allocate_clusters(SnapshotImage& im, uint64_t n);
// Drops one reference from every cluster [host, host + bytes) touches.
Task<Status> release_range(SnapshotImage& im, HostOffset host, uint64_t bytes);

// Writes the dirty refcount blocks and reftable entries and flushes; then
// discards the clusters freed meanwhile (QEMU's pass-discard-snapshot).
Task<Status> write_refcounts(SnapshotImage& im);

// Replaces the snapshot table by `next` as qcow2_write_snapshots() does: the
// new table in new clusters (their refcounts written first), flush, the two
// header fields (nb_snapshots, snapshots_offset) in one write, flush, then the
// old table's clusters freed.
Task<Status> replace_snapshot_table(SnapshotImage& im, std::vector<Snapshot> next);

// Writes the header's size, crypt_method, l1_size and l1_table_offset (one
// write: the fields are adjacent) from im.header, and flushes.
Task<Status> write_l1_location(SnapshotImage& im);

}  // namespace qcowfs::image::qcow2
