// Copy-on-read: QEMU's copy-on-read=on (block/io.c bdrv_co_do_copy_on_readv,
// the copy-on-read filter) over any writable BlockDriver (without a backing
// file it copies unallocated ranges as zeros, as QEMU does).
// A read of a range not allocated in the top image (its block_status says
// depth > 0, or no layer records it) reads the range padded to whole clusters
// through the driver, writes those bytes into the top image (write_zeroes
// where they are all zeros, as QEMU does) and returns them; ranges allocated
// in the top image are read as usual. What the guest sees does not change.
//
// A racing guest write wins: QEMU serialises a copy-on-read request with every
// request touching the same clusters; here the wrapper holds an exclusive
// range lock over the padded clusters while it checks allocation, reads and
// writes, and every guest write, discard and write-zeroes holds its clusters
// shared. The allocation check is repeated under the lock, so a cluster a
// guest write allocated meanwhile is read, never copied over. A failed copy
// fails the read (QEMU reports it "in all cases" too).
//
// Thread-safety: as BlockDriver.
#pragma once

#include <memory>

#include "image/block_driver.h"

namespace qcowfs::image {

// Wraps inner (writable, opened with its backing chain) so that its reads copy
// from the backing chain. Refused with EINVAL on a read-only driver, as QEMU
// refuses "copy-on-read on read-only device".
Result<std::unique_ptr<BlockDriver>> make_copy_on_read(std::unique_ptr<BlockDriver> inner);

}  // namespace qcowfs::image
