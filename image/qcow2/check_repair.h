// The comparing and repairing half of `qcowfs check` (image/qcow2/qcow2_check.h):
// the refcounts as stored (StoredRefcounts), their comparison with the counts
// of the walk (image/qcow2/check_walk.h) with leak repair in place, the
// OFLAG_COPIED check and repair, and the writing of a rebuilt refcount
// structure. Every problem is a line in the CheckReport and a counter.
// Thread-safety: as qcow2_check.h: one coroutine owns the HostFile meanwhile;
// a StoredRefcounts must not outlive the file and header it was given.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "image/qcow2/header.h"
#include "image/qcow2/qcow2_check.h"
#include "image/qcow2/refcount_entry.h"
#include "io/buffer.h"
#include "io/host_file.h"
#include "io/status.h"
#include "io/task.h"

namespace qcowfs::image::qcow2 {

// Refcount blocks of the image as stored, read on demand (zero-padded past the
// end of the file) and written back when changed (leak repair). Two reftable
// entries naming the same block share it.
class StoredRefcounts {
 public:
  StoredRefcounts(io::HostFile& file, const Header& h, std::vector<uint64_t> table)
      : file_(file), map_(h.cluster_bits, h.refcount_order), table_(std::move(table)) {}

  // The stored refcount of host cluster hc; 0 beyond the table or in an absent block.
  Task<Result<uint64_t>> get(HostCluster hc);
  // Sets a stored refcount in place; false when no block covers hc.
  Task<Result<bool>> set(HostCluster hc, uint64_t value);
  // Writes the changed blocks and flushes.
  Task<Status> write_back();

 private:
  struct Block {
    io::AlignedBuffer buf;
    bool dirty = false;
  };
  // The block covering hc; nullptr when there is none.
  Task<Result<Block*>> block_for(HostCluster hc);

  io::HostFile& file_;
  const RefcountMap map_;
  std::vector<uint64_t> table_;
  std::map<HostOffset, Block> blocks_;
};

// Compares stored and counted refcounts of host clusters [0, max(nb_clusters,
// counted.size())) (QEMU's compare_refcounts()); with fix_leaks, leaked
// refcounts are lowered in place. highest: the last host cluster in use.
Task<Status> compare_refcounts(StoredRefcounts& stored, const std::vector<uint64_t>& counted, uint64_t nb_clusters,
                               bool fix_leaks, CheckReport& r, HostCluster& highest);

// OFLAG_COPIED of the active L1 entries and of the L2 entries they name must
// be set exactly when the refcount is 1 (QEMU's check_oflag_copied()); with
// fix, wrong flags are corrected in place.
Task<Status> check_oflag_copied(io::HostFile& f, const Header& h, StoredRefcounts& stored, CheckReport& r, bool fix,
                                std::vector<uint64_t> active_l1);

// Writes a refcount structure holding `counted` (references per host cluster)
// after the last used cluster, then switches the header to it (see
// rebuild_refcounts() in qcow2_check.h); h is updated.
Task<Status> write_refcount_structure(io::HostFile& f, Header& h, std::vector<uint64_t> counted);

}  // namespace qcowfs::image::qcow2
