// Parallels header parsing: a pure function over the first 64 bytes with
// QEMU 7.2's checks (parallels_open), and the walk of the format extension
// cluster's features (parallels_read_format_extension).
// Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "image/parallels/format.h"
#include "io/status.h"

namespace qcowfs::image::parallels {

struct Header {
  uint64_t off_multiplier = 0;  // sectors a BAT unit
  uint32_t tracks = 0;          // sectors a cluster
  uint32_t bat_entries = 0;
  uint64_t nb_sectors = 0;      // guest size
  bool inuse = false;           // not closed cleanly (read-only opens ignore it, as QEMU's do)
  uint32_t data_off = 0;        // first data sector; 0: right after the BAT
  uint64_t ext_off = 0;         // format extension, in sectors; 0: none
  uint64_t cluster_size() const { return uint64_t{tracks} * kSector; }
};

Result<Header> parse_header(std::span<const std::byte, kHeaderSize> b, const std::string& path);

// Checks the format extension cluster's first bytes (ext: up to the cluster
// size, zeros past the end of the file; cluster_size: the whole cluster's).
Status check_extension(std::span<const std::byte> ext, uint64_t cluster_size, uint64_t nb_sectors,
                       const std::string& path);

}  // namespace qcowfs::image::parallels
