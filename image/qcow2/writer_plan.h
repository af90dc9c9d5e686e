// The request-local types of Qcow2Writer (image/qcow2/writer.h): one Slot per
// guest cluster a write touches, and the Plan of a whole request (its slots,
// the L2 slices they live in, the host run allocated for it). Internal to the
// writer_*.cc files.
//
// Byte offsets in a Slot named *_start / *_end are offsets inside the guest
// cluster (0 .. cluster size), not guest or host offsets.
//
// Thread-safety: a Plan belongs to one request.
#pragma once

#include <sys/uio.h>

#include <cstdint>
#include <vector>

#include "image/qcow2/writer.h"
#include "io/buffer.h"
#include "io/inline_vector.h"

namespace qcowfs::image::qcow2 {

// Subcluster bits [first_sc, last_sc] of an extended L2 bitmap.
inline uint64_t subcluster_mask(uint64_t first_sc, uint64_t last_sc) {
  const uint64_t n = last_sc - first_sc + 1;
  return (n >= 64 ? ~uint64_t{0} : ((uint64_t{1} << n) - 1)) << first_sc;
}

inline constexpr uint64_t kAllSubclustersZero = kSubclusterAllocMask << kSubclusterZeroShift;

// One guest cluster of a request.
struct Qcow2Writer::Slot {
  GuestCluster gc = 0;
  Kind kind = Kind::overwrite;
  uint64_t old_entry = 0, old_bitmap = 0;
  HostOffset host = 0;                  // host cluster offset (existing or new)
  uint64_t wr_start = 0, wr_end = 0;    // bytes of the cluster written to the host
  uint64_t map_start = 0, map_end = 0;  // bytes the new L2 entry maps (from classify)
  bool fresh = false;                   // host cluster known to read as zeros: no COW read
  uint64_t rq_start = 0, rq_end = 0;    // bytes of the cluster the request covers
  size_t slice = 0;                     // index into Plan::slices
  size_t index = 0;                     // entry index inside that slice
  io::AlignedBuffer cow;                // [wr_start, wr_end) when it is wider than the request
                                        // (fresh: the request padded with zeros to the host alignment)
  // Kind::compressed: the stream (its first csize bytes); once placed, `host`
  // is the stream's first byte and the clusters it touches hold a reference.
  io::AlignedBuffer packed;
  uint64_t csize = 0;
  bool placed = false;
  bool needs_cow() const { return wr_start != rq_start || wr_end != rq_end; }
};

// The lists hold two slots and one slice inline: a request inside one or two
// clusters (every small write) allocates nothing for its plan.
struct Qcow2Writer::Plan {
  InlineVector<Slot, 2> slots;
  InlineVector<TableCache::Ref, 1> slices;
  HostCluster first_hc = 0;  // host clusters allocated for this request
  uint64_t run_clusters = 0;

  // Empty again, as constructed (a mapping that starts over).
  void reset() {
    slots.clear();
    slices.clear();
    first_hc = 0;
    run_clusters = 0;
  }
};

// One host-contiguous write of a request: head COW + guest data + tail COW
// of consecutive slots whose host clusters follow each other. (Not
// image::HostRun, which is host space reserved for units: image/extent/writer.h.)
struct Qcow2Writer::HostWrite {
  HostOffset host = 0;
  uint64_t len = 0;
  std::vector<iovec> iov;
};

}  // namespace qcowfs::image::qcow2
