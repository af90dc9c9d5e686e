// ClusterAllocator: finds and reserves host clusters of a writable qcow2 image
// on top of its RefcountTable. allocate(n) returns n contiguous clusters with
// refcount 1: the first free run of n clusters found scanning from a hint (the
// lowest cluster that may be free), else the end of the used area. Clusters
// freed by release() lower the hint so their runs are reused. Refcount blocks a
// run needs are created on the way (placed on the first cluster of the run,
// covering themselves or covered by an existing block), so a run can move by
// the clusters those blocks take.
//
// When a run lies beyond what the refcount table covers, allocate() fails with
// EAGAIN and the caller runs grow_table() (which needs the writeback lock as
// well as the metadata lock) and retries.
//
// Compressed clusters take bytes, not clusters: allocate_bytes() packs them
// as QEMU's qcow2_alloc_bytes does (block/qcow2-refcount.c, QEMU 7.2). The
// next stream starts right after the last one, at any byte, inside the partly
// used cluster; one that does not fit there continues into the next host
// cluster when the new cluster allocate(1) hands out follows it, else starts
// at the new cluster (the old one's tail stays unused). Every host cluster a
// stream touches takes one more reference, so a cluster holding the ends of
// several streams has a refcount of that many. The partly used cluster is
// remembered in memory only (a new session starts a new cluster), and is
// forgotten when its refcount is at the maximum or it is freed.
//
// A cluster whose refcount has dropped in memory is free for reuse at once;
// the write path only releases a cluster after the L2/L1 update that dropped
// it is on disk (image/qcow2/metadata.h), so reuse never races with stale
// references.
//
// Thread-safety: none; called with the image's metadata lock held.
#pragma once

#include <cstdint>
#include <vector>

#include "image/qcow2/format.h"
#include "image/qcow2/refcount.h"
#include "io/status.h"
#include "io/task.h"

namespace qcowfs::image::qcow2 {

class ClusterAllocator {
 public:
  // end_hc: first host cluster past everything in use (file end or refcounts).
  ClusterAllocator(RefcountTable& refcounts, HostCluster end_hc) : rt_(refcounts), end_(end_hc), hint_(end_hc) {}

  // Reserves n (> 0) contiguous clusters; returns the first one.
  // EAGAIN: grow_table() first. Nothing is reserved on failure.
  Task<Result<HostCluster>> allocate(uint64_t n);
  // Grows the refcount table to cover what the last EAGAIN asked for.
  Task<Status> grow_table();
  // Drops one reference from each of [first_hc, first_hc + n); appends the
  // clusters that became free to *freed (may be null).
  Task<Status> release(HostCluster first_hc, uint64_t n, std::vector<HostCluster>* freed);
  // Starts the free-run scan at hc (e.g. after an image-wide rebuild).
  void set_hint(HostCluster hc);

  // Where allocate_bytes put a stream: its first byte, and the host cluster
  // it allocated for it (0: it fitted in the partly used one).
  struct ByteRun {
    HostOffset offset = 0;
    HostCluster new_cluster = 0;
  };
  // Reserves size (1 .. cluster size - 1) bytes for one compressed cluster,
  // taking a reference on every host cluster they touch (see above).
  // EAGAIN: grow_table() first; nothing is reserved on failure.
  Task<Result<ByteRun>> allocate_bytes(uint64_t size);
  // The byte where the next stream would start (0: a new cluster).
  HostOffset free_byte_offset() const { return free_byte_; }

  HostCluster end_cluster() const { return end_; }
  HostCluster hint() const { return hint_; }

 private:
  Task<Result<HostCluster>> find_free_run(uint64_t n);

  RefcountTable& rt_;
  HostCluster end_;
  HostCluster hint_;             // no free cluster below it
  uint64_t failed_n_ = 0;        // a scan from hint_ found no run this long (0: none failed)
  uint64_t grow_to_entries_ = 0; // reftable entries the last EAGAIN needs
  HostOffset free_byte_ = 0;      // next free byte inside the partly used cluster (0: none)
};

}  // namespace qcowfs::image::qcow2
