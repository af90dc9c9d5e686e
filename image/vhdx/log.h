// The VHDX log on open: QEMU (block/vhdx-log.c, vhdx_parse_log) searches the
// log of the current header for a valid sequence of entries and, when it finds
// one, replays it on a read-write open and refuses a read-only open. qcowfs
// opens read-only, so check_log() answers whether the image may be read as it
// is: ok when the log is empty (zero log GUID or length) or holds no valid
// entry; EPERM, with QEMU's advice to replay it, when it does; EINVAL for the
// fields QEMU refuses (log offset, version, length, an invalid descriptor in an
// entry with a valid header).
// Thread-safety: one call at a time per file (it reads through its own buffer).
#pragma once

#include <string>

#include "image/vhdx/header.h"
#include "io/host_file.h"
#include "io/status.h"
#include "io/task.h"

namespace qcowfs::image::vhdx {

Task<Status> check_log(io::HostFile& file, const Header& header, const std::string& path);

}  // namespace qcowfs::image::vhdx
