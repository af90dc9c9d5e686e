// VDI header: parsed from the first 512 bytes of the image and checked the way
// QEMU 7.2's vdi_open() checks it.
// Thread-safety: plain values and pure functions.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "image/vdi/format.h"
#include "io/host_file.h"
#include "io/status.h"
#include "io/task.h"

namespace qcowfs::image::vdi {

struct Header {
  uint32_t image_type = 0;
  uint32_t offset_bmap = 0;
  uint32_t offset_data = 0;
  uint64_t disk_size = 0;  // rounded up to whole sectors, as QEMU does
  uint32_t block_size = 0;
  uint32_t blocks_in_image = 0;
  uint32_t blocks_allocated = 0;

  bool is_static() const { return image_type == kTypeStatic; }
  // Block map entries that map [0, disk_size).
  uint64_t blocks_for_disk() const { return (disk_size + block_size - 1) / block_size; }
};

// Parses and checks the header bytes (zero-padded to kHeaderBytes when the
// file is shorter). Errors carry QEMU's wording and the path: EINVAL for a
// bad signature, ENOTSUP for what QEMU does not support.
Result<Header> parse_header(std::span<const std::byte> bytes, const std::string& path);

// Reads the header at the start of file and parses it (parse_header).
Task<Result<Header>> read_header(io::HostFile& file, const std::string& path);

}  // namespace qcowfs::image::vdi
