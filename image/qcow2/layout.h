// Where a writable qcow2 image's metadata lives: the ranges QEMU's overlap
// checks test guest data writes against.
//
// MetadataLayout lists the host ranges holding metadata when the image is
// opened for writing: header cluster, L1 table, refcount table and blocks, the
// L2 tables the active L1 names, snapshot table and snapshot L1 tables. Built
// by build_metadata_layout(), which fails with EIO naming the first structure
// that is unaligned, outside the file, inside the header or overlapping
// another. A data write whose host range overlaps the layout is corruption
// (the writer hands it to image/qcow2/corruption.h).
//
// Thread-safety: a MetadataLayout is immutable after building.
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

struct MetadataRange {
  HostOffset start = 0;
  HostOffset end = 0;  // exclusive
  std::string what;   // "L1 table", "refcount block 3", ...
};

class MetadataLayout {
 public:
  // The first metadata range overlapping [host, host + len), if any.
  const MetadataRange* overlap(HostOffset host, uint64_t len) const;
  bool empty() const { return ranges_.empty(); }

  // Adds a range; EIO when it overlaps one already present.
  Status add(MetadataRange r);

 private:
  std::vector<MetadataRange> ranges_;  // sorted by start, disjoint
};

Task<Result<MetadataLayout>> build_metadata_layout(io::HostFile& file, const Header& h,
                                                   std::span<const uint64_t> l1,
                                                   const std::vector<Snapshot>& snapshots);

}  // namespace qcowfs::image::qcow2
