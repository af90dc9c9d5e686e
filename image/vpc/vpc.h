// The VHD format (QEMU's "vpc" driver), read-only: fixed, dynamic and
// differencing disks, read the way QEMU 7.2's block/vpc.c reads them (a
// differencing disk as a dynamic one, without its parent). DESIGN.md has the
// layout and the rules matched. Thread-safety: open_vpc() is a free function;
// the driver it returns follows BlockDriver's rules.
#pragma once

#include <memory>
#include <string>

#include "image/block_driver.h"

namespace qcowfs::image {

// The registry's entry point (image/format.h). A read-write open is refused
// with EROFS.
Task<Result<std::unique_ptr<BlockDriver>>> open_vpc(std::unique_ptr<io::HostFile> file, std::string path,
                                                    ImageOptions opts);

}  // namespace qcowfs::image
