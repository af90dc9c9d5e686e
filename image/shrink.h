// The one rule every format follows when a disk shrinks: never over data. A
// shrink is allowed only when every byte past the new end reads as a hole
// (nothing stored in the image or anywhere in its backing chain); otherwise
// it is refused with EINVAL and the disk is left as it is. Drivers call
// check_shrink() before changing anything; a driver may refuse more (qcow2
// also refuses over allocated zero clusters).
// Thread-safety: as BlockDriver::block_status().
#pragma once

#include <cstdint>

#include "image/block_driver.h"
#include "io/status.h"
#include "io/task.h"

namespace qcowfs::image {

// ok when [new_size, disk.size()) holds no data (or new_size >= size());
// EINVAL naming the first offset that does.
Task<Status> check_shrink(BlockDriver& disk, uint64_t new_size);

}  // namespace qcowfs::image
