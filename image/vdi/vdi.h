// VDI format driver entry point (read-only; image/vdi/DESIGN.md).
// Thread-safety: as BlockDriver.
#pragma once

#include <memory>
#include <string>

#include "image/block_driver.h"

namespace qcowfs::image {

// Opens a VDI image on an already opened host file, read-only (a writable
// open is refused with EROFS). path names the image in messages.
Task<Result<std::unique_ptr<BlockDriver>>> open_vdi(std::unique_ptr<io::HostFile> file, std::string path,
                                                    ImageOptions opts);

}  // namespace qcowfs::image
