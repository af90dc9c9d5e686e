// VHDX format driver entry point (read-only; see image/vhdx/DESIGN.md).
// Thread-safety: as BlockDriver.
#pragma once

#include <memory>
#include <string>

#include "image/block_driver.h"

namespace qcowfs::image {

// Opens a VHDX image read-only on an already opened host file; a writable
// open is refused (EROFS). path names the image in messages.
Task<Result<std::unique_ptr<BlockDriver>>> open_vhdx(std::unique_ptr<io::HostFile> file, std::string path,
                                                     ImageOptions opts);

}  // namespace qcowfs::image
