// Where a writable qcow2 image's metadata lives, and what happens when a write
// would land on it: QEMU's overlap checks and qcow2_signal_corruption.
//
// MetadataLayout lists the host ranges holding metadata when the image is
// opened for writing: header cluster, L1 table, refcount table and blocks, the
// L2 tables the active L1 names, snapshot table and snapshot L1 tables. Built
// by build_metadata_layout(), which fails with EIO naming the first structure
// that is unaligned, outside the file, inside the header or overlapping
// another. A data write whose host range overlaps the layout is corruption.
//
// signal_corruption() sets the corrupt bit (incompatible bit 1) in the header
// on disk, once, and flips Qcow2Image::corrupt so every later write, discard
// and resize fails with EIO while reads go on.
//
// Thread-safety: a MetadataLayout is immutable after building; signal_corruption()
// may be called from any event-loop thread (the flag is atomic).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "image/qcow2/header.h"
#include "image/qcow2/snapshot.h"
#include "io/host_file.h"
#include "io/status.h"
#include "io/task.h"

namespace qcowfs::image::qcow2 {

struct Qcow2Image;

struct MetadataRange {
  uint64_t start = 0;
  uint64_t end = 0;   // exclusive
  std::string what;   // "L1 table", "refcount block 3", ...
};

class MetadataLayout {
 public:
  // The first metadata range overlapping [off, off + len), if any.
  const MetadataRange* overlap(uint64_t off, uint64_t len) const;
  bool empty() const { return ranges_.empty(); }

  // Adds a range; EIO when it overlaps one already present.
  Status add(MetadataRange r);

 private:
  std::vector<MetadataRange> ranges_;  // sorted by start, disjoint
};

Task<Result<MetadataLayout>> build_metadata_layout(io::HostFile& file, const Header& h,
                                                   std::span<const uint64_t> l1,
                                                   const std::vector<Snapshot>& snapshots);

// Marks the image corrupt (on disk and in memory) and returns the EIO Status
// for the request that found it. `what` says what was found.
Task<Status> signal_corruption(Qcow2Image& img, std::string what);

}  // namespace qcowfs::image::qcow2
