// The counting half of `qcowfs check` (image/qcow2/qcow2_check.h): one walk
// over all metadata that counts the references to every host cluster, as
// QEMU's calculate_refcounts() does, recording each problem it meets in the
// CheckReport (a message, and a corruption or check error) instead of
// stopping. L2 entries are read through decode_l2_entry() (image/qcow2/l2.h).
// Thread-safety: as qcow2_check.h: one coroutine owns the HostFile meanwhile.
#pragma once

#include <cstdint>
#include <vector>

#include "image/qcow2/header.h"
#include "image/qcow2/qcow2_check.h"
#include "io/host_file.h"
#include "io/status.h"
#include "io/task.h"

namespace qcowfs::image::qcow2 {

// The reftable entries as stored (not masked, not checked).
Task<Result<std::vector<uint64_t>>> read_reftable(io::HostFile& f, const Header& h);

// What the walk found.
struct Counts {
  std::vector<uint64_t> counted;    // references per host cluster
  std::vector<uint64_t> active_l1;  // the active L1 table's entries
  bool rebuild_needed = false;      // the refcount structure itself is broken
};

// Counts every reference: header, active and snapshot L1/L2 tables and what
// they map, snapshot table, encryption header, bitmaps; with a reftable, also
// the refcount table and blocks (QEMU's check_refblocks()).
Task<Result<Counts>> count_references(io::HostFile& f, const Header& h, CheckReport& r, const CheckOptions& opts,
                                      const std::vector<uint64_t>* reftable);

}  // namespace qcowfs::image::qcow2
