// Reading qcow2 metadata straight from an image file for the tools (info,
// check, create's verification): the header, the snapshot table and the
// persistent bitmap directory (zero-padded reads: image/extent/host_read.h); refcount entries
// through image/qcow2/refcount_entry.h. Unlike the driver, nothing here is cached.
// Thread-safety: free functions; the HostFile's own rules apply.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "image/extent/host_read.h"
#include "image/qcow2/header.h"
#include "image/qcow2/refcount_entry.h"
#include "image/qcow2/snapshot.h"
#include "io/buffer.h"
#include "io/host_file.h"
#include "io/status.h"
#include "io/task.h"

namespace qcowfs::image::qcow2 {

struct Bitmap {
  std::string name;
  uint64_t table_offset = 0;
  uint32_t table_size = 0;  // entries
  uint32_t flags = 0;
  uint8_t granularity_bits = 0;
  uint64_t granularity() const { return uint64_t{1} << granularity_bits; }
};

// Reads and validates the header (image/qcow2/header.h rules).
Task<Result<Header>> read_qcow2_header(io::HostFile& f);

// Reads the snapshot table (table_bytes gives its size on disk).
Task<Result<SnapshotTable>> read_qcow2_snapshots(io::HostFile& f, const Header& h);

// Parses the bitmap directory bytes; names and sizes are bounded by the buffer.
Result<std::vector<Bitmap>> parse_bitmap_directory(std::span<const std::byte> dir, uint32_t nb_bitmaps);

// Reads the bitmap directory when the bitmaps extension is present and the
// autoclear bit says it is valid (QEMU ignores it otherwise); empty if none.
Task<Result<std::vector<Bitmap>>> read_qcow2_bitmaps(io::HostFile& f, const Header& h);

}  // namespace qcowfs::image::qcow2
