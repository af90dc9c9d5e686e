// Detecting an image made with preallocation=metadata, for the block status
// details qemu-img map shows for qcow2 images beyond what the L2 tables say:
// QEMU guesses whether an image was created so (its data clusters then mostly
// sit in host holes) and, for such images only, asks the host file which parts
// of a data range are holes (image/extent/host_holes.h), reporting those as data
// that reads as zeros.
//
// Thread-safety: free functions; each call uses only its arguments.
#pragma once

#include <cstdint>

#include "image/block_driver.h"
#include "image/qcow2/header.h"
#include "io/host_file.h"
#include "io/status.h"
#include "io/task.h"

namespace qcowfs::image::qcow2 {

// qemu's qcow2_detect_metadata_preallocation(): true when at least as many
// clusters of the image file have a non-zero refcount as the host has
// allocated plus a margin (a ninth, at least two clusters). Reads the on-disk
// refcounts.
Task<Result<bool>> detect_metadata_preallocation(io::HostFile& image_file, const Header& h);

}  // namespace qcowfs::image::qcow2
