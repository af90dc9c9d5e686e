// `qcowfs create -f vdi` (image/create.h): QEMU 7.2's vdi_co_do_create()
// layout, options and refusals:
//
//   0      the 512-byte header (version 1.1, 1 MiB blocks, two random UUIDs)
//   512    the block map, whole sectors: every block unallocated (dynamic) or
//          block i at data block i (static=on)
//   then   static=on only: the data blocks, the file truncated to hold them
//
// Options: static=on|off (default off). The size is rounded up to whole
// sectors, at most QEMU's VDI_DISK_SIZE_MAX.
// Thread-safety: a pure function; the Creator it returns is used once.
#pragma once

#include <memory>

#include "image/create.h"

namespace qcowfs::image {

Result<std::unique_ptr<Creator>> prepare_vdi_create(const CreateRequest& request);

}  // namespace qcowfs::image
