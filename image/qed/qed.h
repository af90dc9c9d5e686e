// QED format driver entry point (read-only; image/qed/DESIGN.md).
// Thread-safety: as BlockDriver.
#pragma once

#include <memory>
#include <string>

#include "image/block_driver.h"

namespace qcowfs::image {

// Opens a QED image on an already opened host file, read-only (a writable
// open is refused with EROFS). path resolves a relative backing file name and
// names the image in messages.
Task<Result<std::unique_ptr<BlockDriver>>> open_qed(std::unique_ptr<io::HostFile> file, std::string path,
                                                    ImageOptions opts);

}  // namespace qcowfs::image
