// `qcowfs check` of a Parallels image: QEMU 7.2's parallels_co_check()
// (block/parallels.c) behind the registry's CheckFormatFn (image/check.h).
// Corruptions: the in-use flag of an image not closed cleanly, and BAT
// entries naming a cluster past the end of the file (-r all clears both);
// leaks: the clusters' worth of file past the last cluster (image-end-offset),
// truncated by -r leaks and -r all. Reports total-clusters (the BAT's
// entries), allocated-clusters, fragmented-clusters and image-end-offset as
// QEMU does, and its messages ("ERROR cluster 3 is outside image", ...).
// Any -r then does what closing QEMU's read-write open does: the in-use flag
// is cleared and the file is extended to the data end (see check.cc).
// Thread-safety: as CheckFormatFn.
#pragma once

#include <string>

#include "image/check.h"

namespace qcowfs::image {

Task<Result<CheckReport>> check_parallels(io::HostFile& file, std::string path, CheckOptions opts);

}  // namespace qcowfs::image
