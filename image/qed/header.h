// QED header: parsed from the first 64 bytes of the image and checked the way
// QEMU 7.2's bdrv_qed_do_open() checks it, with the geometry derived from it.
// Thread-safety: plain values and pure functions.
#pragma once

#include <bit>
#include <cstdint>
#include <span>
#include <string>

#include "image/qed/format.h"
#include "io/host_file.h"
#include "io/status.h"
#include "io/task.h"

namespace qcowfs::image::qed {

struct Header {
  uint32_t cluster_size = 0;
  uint32_t table_size = 0;
  uint32_t header_size = 0;
  uint64_t features = 0;
  uint64_t l1_table_offset = 0;
  uint64_t image_size = 0;
  uint32_t backing_filename_offset = 0;
  uint32_t backing_filename_size = 0;

  // Derived (QEMU's BDRVQEDState): the file size rounded down to whole
  // clusters, entries per table, shifts and mask of a guest offset.
  uint64_t file_size = 0;
  uint32_t table_nelems = 0;
  uint32_t l2_shift = 0;
  uint32_t l1_shift = 0;
  uint64_t l2_mask = 0;

  bool has_backing() const { return (features & kFeatureBackingFile) != 0; }
  bool backing_is_raw() const { return (features & kFeatureBackingFormatNoProbe) != 0; }
  bool need_check() const { return (features & kFeatureNeedCheck) != 0; }
  uint64_t cluster_mask() const { return cluster_size - 1ull; }
  uint64_t table_bytes() const { return uint64_t{cluster_size} * table_size; }
  // Guest bytes one L2 table maps.
  uint64_t l1_span() const { return uint64_t{1} << l1_shift; }
  // L1 entries that map [0, image_size).
  uint64_t l1_entries() const { return image_size == 0 ? 0 : (image_size - 1) / l1_span() + 1; }

  // QEMU's qed_check_cluster_offset(): cluster-aligned, past the header, in
  // the file (of file_size bytes, rounded down to clusters; default: the
  // size at open).
  bool valid_cluster_offset(uint64_t host) const { return valid_cluster_offset(host, file_size); }
  bool valid_cluster_offset(uint64_t host, uint64_t file_bytes) const;
  // QEMU's qed_check_table_offset(). Like QEMU, never true for one-cluster
  // tables: its overflow check (end <= start) rejects them.
  bool valid_table_offset(uint64_t host) const { return valid_table_offset(host, file_size); }
  bool valid_table_offset(uint64_t host, uint64_t file_bytes) const;
};

// Parses and checks the header bytes (zero-padded to kHeaderBytes when the
// file is shorter) of a file of file_size bytes. Errors carry QEMU's wording,
// the field and path: EINVAL, or ENOTSUP for unknown feature bits.
Result<Header> parse_header(std::span<const std::byte> bytes, uint64_t file_size, const std::string& path);

// Reads the header at the start of file and parses it (parse_header).
Task<Result<Header>> read_header(io::HostFile& file, const std::string& path);

// v is a power of two in [lo, hi] (cluster and table sizes).
inline bool power_of_two_in(uint64_t v, uint64_t lo, uint64_t hi) {
  return v >= lo && v <= hi && std::has_single_bit(v);
}

// QEMU's qed_max_image_size(), with its uint64 arithmetic (it wraps to 0 for
// the largest cluster and table sizes, which QEMU then refuses).
uint64_t max_image_size(uint32_t cluster_size, uint32_t table_size);

}  // namespace qcowfs::image::qed
