// qcow2 format driver entry point (see image/qcow2/*.h for the parts).
// Thread-safety: as BlockDriver.
#pragma once

#include <memory>
#include <string>

#include "image/block_driver.h"

namespace qcowfs::image {

// Opens a qcow2 image on an already opened host file. path is used to resolve
// relative backing and data file names and in messages.
Task<Result<std::unique_ptr<BlockDriver>>> open_qcow2(std::unique_ptr<io::HostFile> file,
                                                      std::string path, ImageOptions opts);

}  // namespace qcowfs::image
