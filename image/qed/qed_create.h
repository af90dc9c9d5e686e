// `qcowfs create -f qed` (image/create.h): QEMU 7.2's bdrv_qed_co_create()
// layout, options, defaults and refusals:
//
//   cluster 0                 header (64 bytes), the backing file name after it
//   clusters 1 .. table_size  the L1 table, all zeros
//
// Options: cluster_size (default 64K, 4K..64M, a power of two), table_size (in
// clusters, default 4, 1..16, a power of two), backing_file/backing_fmt (a raw
// backing file is marked so that QEMU does not probe it).
// Thread-safety: a pure function; the Creator it returns is used once.
#pragma once

#include <memory>

#include "image/create.h"

namespace qcowfs::image {

Result<std::unique_ptr<Creator>> prepare_qed_create(const CreateRequest& request);

}  // namespace qcowfs::image
