// qcow2 format driver entry point (see image/qcow2/*.h for the parts).
// Thread-safety: as BlockDriver.
#pragma once

#include <memory>
#include <string>

#include "image/block_driver.h"
#include "image/check.h"
#include "image/describe.h"

namespace qcowfs::image {

// Opens a qcow2 image on an already opened host file. path is used to resolve
// relative backing and data file names and in messages.
Task<Result<std::unique_ptr<BlockDriver>>> open_qcow2(std::unique_ptr<io::HostFile> file,
                                                      std::string path, ImageOptions opts);

// The registry's check (image/check.h): qcow2_check.h's check_image().
Task<Result<CheckReport>> check_qcow2(io::HostFile& file, std::string path, CheckOptions opts);

// The registry's describe (image/describe.h): header, snapshot table, bitmaps
// and LUKS header read from the file (qcow2_inspect.h), no key needed.
Task<Result<ImageDescription>> describe_qcow2(std::unique_ptr<io::HostFile> file, std::string path,
                                              ImageOptions opts);

}  // namespace qcowfs::image
