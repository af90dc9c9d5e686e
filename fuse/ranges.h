// Bounds rules of the raw view, as pure functions so they are unit-tested
// apart from the kernel. The view is a disk of a fixed size, and behaves as a
// block device does at its end: reads past the end are short (0 at or past
// it); a write that crosses the end writes up to it and returns the short
// count; a write that starts at or past the end fails with ENOSPC. fallocate
// maps onto the BlockDriver's zeroing calls. The size is always the driver's
// current size, so a resize (setattr) moves the limit.
// Thread-safety: pure functions.
#pragma once

#include <cstdint>

#include "io/status.h"

namespace qcowfs::fuse {

// Bytes a read of len at off returns on a view of `size` bytes (0 at or past EOF).
uint64_t readable_bytes(uint64_t off, uint64_t len, uint64_t size);

// Bytes a write of len at off stores on a view of `size` bytes: all of them
// inside the view, the part up to the end when it crosses the end (a short
// write), 0 for an empty write; ENOSPC when a non-empty write starts at or
// past the end (what a block device answers).
Result<uint64_t> writable_bytes(uint64_t off, uint64_t len, uint64_t size);

// What a fallocate(mode, off, len) does to the view.
struct FallocatePlan {
  enum class Action {
    nothing,        // mode 0 / KEEP_SIZE: every byte already exists
    zero_unmap,     // PUNCH_HOLE|KEEP_SIZE: write_zeroes(may_unmap = true)
    zero_allocate,  // ZERO_RANGE: write_zeroes(may_unmap = false)
  };
  Action action = Action::nothing;
  uint64_t offset = 0;
  uint64_t length = 0;  // clamped to the view (may be 0: then nothing to do)
};

// Plans a fallocate; EOPNOTSUPP for modes other than 0, KEEP_SIZE,
// PUNCH_HOLE|KEEP_SIZE and ZERO_RANGE(|KEEP_SIZE); EFBIG when the range
// would grow the view; EINVAL for an empty range.
Result<FallocatePlan> plan_fallocate(int mode, uint64_t off, uint64_t len, uint64_t size);

}  // namespace qcowfs::fuse
