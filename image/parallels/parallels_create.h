// `qcowfs create -f parallels` (image/create.h): QEMU 7.2's
// parallels_co_create() layout, options and refusals:
//
//   0       the 64-byte header ("WithouFreSpacExt", version 2, 16 heads)
//   64      the BAT, every entry 0 (unallocated), zero-padded to whole clusters
//   then    data clusters, appended as they are written
//
// Options: cluster_size (default 1 MiB). The size and the cluster size are
// rounded up to whole sectors, as QEMU silently rounds them.
// Thread-safety: a pure function; the Creator it returns is used once.
#pragma once

#include <memory>

#include "image/create.h"

namespace qcowfs::image {

Result<std::unique_ptr<Creator>> prepare_parallels_create(const CreateRequest& request);

}  // namespace qcowfs::image
