// The Parallels format (QEMU's "parallels" driver), read-only, as QEMU 7.2's
// block/parallels.c reads it. DESIGN.md has the layout and the rules matched.
// Thread-safety: open_parallels() is a free function; the driver it returns
// follows BlockDriver's rules.
#pragma once

#include <memory>
#include <string>

#include "image/block_driver.h"

namespace qcowfs::image {

// The registry's entry point (image/format.h). A read-write open is refused
// with EROFS.
Task<Result<std::unique_ptr<BlockDriver>>> open_parallels(std::unique_ptr<io::HostFile> file, std::string path,
                                                          ImageOptions opts);

}  // namespace qcowfs::image
