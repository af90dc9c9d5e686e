#include "image/shrink.h"

namespace qcowfs::image {

Task<Status> check_shrink(BlockDriver& disk, uint64_t new_size) {
  const uint64_t size = disk.size();
  for (uint64_t off = new_size; off < size;) {
    auto st = co_await disk.block_status(off, size - off);
    if (!st) co_return st.status();
    if (st->data)
      co_return Status::errorf(EINVAL,
                               "cannot shrink the {}-byte disk to {} bytes: offset {} holds data (a disk only "
                               "shrinks over holes)",
                               size, new_size, off);
    if (st->length == 0) co_return Status::errorf(EIO, "empty block status at offset {}", off);
    off += st->length;
  }
  co_return Status::ok();
}

}  // namespace qcowfs::image
