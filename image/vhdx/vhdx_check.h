// `qcowfs check` for VHDX images (image/check.h): QEMU 7.2's vhdx_co_check().
// Thread-safety: as CheckFormatFn (the check owns the file meanwhile).
#pragma once

#include <string>

#include "image/check.h"
#include "image/vhdx/header.h"

namespace qcowfs::image {

// Opens the image as open_vhdx() does but for the BAT check (QEMU opens with
// BDRV_O_CHECK, which skips it), then counts what vhdx_check_bat_entries()
// finds in every FULLY_PRESENT entry, each a corruption with QEMU's message:
// an offset that overflows, a block starting or ending past the end of the
// file, a payload block overlapping the log or a region. A log that needs
// replay: without a repair mode the open fails (exit 1; QEMU refuses a
// read-only open so); with -r leaks or -r all the file is opened read-write
// and the log replayed first (QEMU's vhdx_parse_log on a BDRV_O_RDWR open),
// counted as one corruption fixed. Nothing else is repaired, as in QEMU.
Task<Result<CheckReport>> check_vhdx(io::HostFile& file, std::string path, CheckOptions opts);

namespace vhdx {

// An image opened up to its BAT (open.cc).
struct Layout {
  Header header;
  Regions regions;
  Parameters params;
  Geometry geometry;
  bool replayed = false;  // the log was replayed on this open
};

// open_vhdx()'s steps before the BAT check on file; with replay, a log that
// needs it is replayed (file opened writable) as a read-write open does.
Task<Result<Layout>> open_for_check(io::HostFile& file, const std::string& path, bool replay);

}  // namespace vhdx
}  // namespace qcowfs::image
