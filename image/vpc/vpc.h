// The VHD format (QEMU's "vpc" driver): fixed, dynamic and differencing
// disks, read the way QEMU 7.2's block/vpc.c reads them (a differencing disk
// as a dynamic one, without its parent); fixed and dynamic disks written as it
// writes them. DESIGN.md has the layout and the rules matched. Thread-safety: open_vpc() is a free function;
// the driver it returns follows BlockDriver's rules.
#pragma once

#include <memory>
#include <string>

#include "image/block_driver.h"

namespace qcowfs::image {

// The registry's entry point (image/format.h). A read-write open of a
// differencing disk, or of a layout a write could spoil, is refused (EROFS,
// EIO).
Task<Result<std::unique_ptr<BlockDriver>>> open_vpc(std::unique_ptr<io::HostFile> file, std::string path,
                                                    ImageOptions opts);

}  // namespace qcowfs::image
