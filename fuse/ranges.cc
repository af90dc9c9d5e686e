#include "fuse/ranges.h"

#include <fcntl.h>
#include <linux/falloc.h>

#include <algorithm>

namespace qcowfs::fuse {
namespace {

// end = off + len, or nothing when that overflows.
bool range_end(uint64_t off, uint64_t len, uint64_t& end) { return !__builtin_add_overflow(off, len, &end); }

}  // namespace

uint64_t readable_bytes(uint64_t off, uint64_t len, uint64_t size) {
  if (off >= size) return 0;
  return std::min(len, size - off);
}

Result<uint64_t> writable_bytes(uint64_t off, uint64_t len, uint64_t size) {
  if (len == 0) return uint64_t{0};
  if (off >= size)
    return Status::errorf(ENOSPC, "write at {} starts at or past the end of the {}-byte disk", off, size);
  return std::min(len, size - off);
}

Result<FallocatePlan> plan_fallocate(int mode, uint64_t off, uint64_t len, uint64_t size) {
  if (len == 0) return Status::error(EINVAL, "fallocate of an empty range");
  const bool keep_size = (mode & FALLOC_FL_KEEP_SIZE) != 0;
  const int op = mode & ~FALLOC_FL_KEEP_SIZE;
  FallocatePlan plan;
  if (op == 0) {
    plan.action = FallocatePlan::Action::nothing;
  } else if (op == FALLOC_FL_PUNCH_HOLE && keep_size) {
    plan.action = FallocatePlan::Action::zero_unmap;
  } else if (op == FALLOC_FL_ZERO_RANGE) {
    plan.action = FallocatePlan::Action::zero_allocate;
  } else {
    return Status::errorf(EOPNOTSUPP, "fallocate mode {:#x} is not supported on a disk image", mode);
  }
  uint64_t end = 0;
  if (!range_end(off, len, end)) return Status::error(EFBIG, "fallocate range overflows");
  if (end > size && !keep_size)
    return Status::errorf(EFBIG, "fallocate [{}, +{}) would grow the {}-byte disk", off, len, size);
  plan.offset = off;
  plan.length = readable_bytes(off, len, size);
  return plan;
}

}  // namespace qcowfs::fuse
