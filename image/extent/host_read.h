// Reading metadata the way QEMU's block layer reads an image file: a read that
// reaches past the end of the file gets zeros for the missing bytes (QEMU's
// file driver pads short reads), so every format's parser sees the same bytes
// QEMU's does. The one read_padded every format uses.
// Thread-safety: a free function; each call uses only its arguments.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "io/host_file.h"
#include "io/status.h"
#include "io/task.h"

namespace qcowfs::image {

// Fills all of buf with the bytes at off, zeros past the end of the file. A
// failed read names the file and what was read: "disk.vhd: reading the VHD
// footer: <error>" when what ("VHD footer") is given, else "reading 4096 bytes
// at 0x10000 of disk.vhd: <error>".
Task<Status> read_padded(io::HostFile& file, uint64_t off, std::span<std::byte> buf, std::string_view what = {});

}  // namespace qcowfs::image
