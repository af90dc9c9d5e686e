// `qcowfs check` for VMDK images (image/check.h): QEMU 7.2's vmdk_co_check().
// Thread-safety: as CheckFormatFn (the check owns the files meanwhile).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "image/block_driver.h"
#include "image/check.h"
#include "image/vmdk/map.h"

namespace qcowfs::image {

// Opens the image as open_vmdk() does (extent files, parent), read-only, then
// walks the disk a grain at a time (a FLAT extent in one step) as QEMU does:
// a grain whose host offset is at or past the end of its extent file, a
// guest offset past an extent's grain directory, or a FLAT extent starting
// at or past the end of its file, stops the walk with QEMU's "ERROR: ..."
// line and fails the check as qemu-img does (CheckReport::failed: "Check
// failed: ...", exit 1, no report). QEMU has no VMDK repair: with a repair
// mode, check_not_supported() (exit 63) once the image opens.
Task<Result<CheckReport>> check_vmdk(io::HostFile& file, std::string path, CheckOptions opts);

namespace vmdk {

// The image open_for_check() opened: its extents, the extent files (the
// image file itself borrowed, the others owned) and the parent, if any.
struct OpenedForCheck {
  std::vector<VExtent> extents;
  std::vector<HostFileState> files;
  std::unique_ptr<BlockDriver> parent;
  uint64_t size = 0;  // guest bytes
};

// open_vmdk()'s reading part on a borrowed image file (vmdk.cc).
Task<Result<OpenedForCheck>> open_for_check(io::HostFile& file, std::string path, ImageOptions opts);

}  // namespace vmdk
}  // namespace qcowfs::image
