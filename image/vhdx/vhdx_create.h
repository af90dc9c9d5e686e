// `qcowfs create -f vhdx` (image/create.h): QEMU 7.2's vhdx_co_create()
// layout, options, defaults and refusals:
//
//   0        file identifier ("vhdxfile", creator "qcowfs")
//   64 KiB   header 1, 128 KiB header 2 (sequence numbers n and n+1, random
//            n, file and data write GUIDs; log at 1 MiB, log GUID zero)
//   192 KiB  region table 1, 256 KiB region table 2 (BAT, metadata)
//   1 MiB    the log (log_size, empty)
//   then     the BAT (whole MiBs), the metadata region (1 MiB: the table, the
//            items at 64 KiB in it), and 4 MiB later the data: empty
//            (dynamic) or the whole disk (fixed)
//
// Options: subformat=dynamic|fixed, block_size (0: chosen from the size, 8 to
// 64 MiB), log_size (default 1 MiB), block_state_zero (default on: every
// block's BAT entry says ZERO, a fixed image's included). The size is rounded
// up to sectors, block and log sizes up to MiBs, as QEMU silently rounds them.
// Thread-safety: a pure function; the Creator it returns is used once.
#pragma once

#include <memory>

#include "image/create.h"

namespace qcowfs::image {

Result<std::unique_ptr<Creator>> prepare_vhdx_create(const CreateRequest& request);

}  // namespace qcowfs::image
