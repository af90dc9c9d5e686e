// Block status through to the host file (QEMU's BDRV_BLOCK_RECURSE): where a
// format stores a data range in a host file whose holes read as zeros,
// qemu-img map reports those holes as data that reads as zeros. qcow2 does it
// for images guessed to be metadata-preallocated, VMDK for flat extents, VDI
// for static images.
// Thread-safety: a free function; each call uses only its arguments.
#pragma once

#include "image/block_driver.h"
#include "io/host_file.h"
#include "io/status.h"
#include "io/task.h"

namespace qcowfs::image {

// The host's view of a data range stored at `st.host_offset` in `data_file`:
// from a host hole on, the range reads as zeros (st.zero = true), shortened to
// the hole (a hole running to the end of the file covers the whole range);
// from host data it is shortened to that data. Past the end of the file
// everything reads as zeros.
Task<Status> apply_host_holes(io::HostFile& data_file, BlockStatus& st);

}  // namespace qcowfs::image
