// VHDX format driver entry point (see image/vhdx/DESIGN.md).
// Thread-safety: as BlockDriver.
#pragma once

#include <memory>
#include <string>

#include "image/block_driver.h"

namespace qcowfs::image {

// Opens a VHDX image on an already opened host file, read-write when
// opts.file.writable (a log that needs replay is replayed first; images qcowfs
// cannot write safely are refused, EIO). path names the image in messages.
Task<Result<std::unique_ptr<BlockDriver>>> open_vhdx(std::unique_ptr<io::HostFile> file, std::string path,
                                                     ImageOptions opts);

}  // namespace qcowfs::image
