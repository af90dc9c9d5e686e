#include "image/views/window.h"

#include <algorithm>

namespace qcowfs::image {

WindowDriver::WindowDriver(BlockDriver* parent, uint64_t offset, uint64_t size)
    : parent_(parent), offset_(offset), size_(size) {}

Status WindowDriver::check_range(uint64_t off, uint64_t len) const {
  if (off > size_ || len > size_ - off)
    return Status::errorf(EINVAL, "request [{:#x}, +{:#x}) is outside the {:#x}-byte window", off, len, size_);
  return Status::ok();
}

Task<Status> WindowDriver::read(uint64_t off, std::span<std::byte> buf) {
  QCOWFS_CO_TRY(check_range(off, buf.size()));
  co_return co_await parent_->read(offset_ + off, buf);
}

std::optional<MappedRead> WindowDriver::map_read(uint64_t off, uint64_t len) {
  if (!check_range(off, len)) return std::nullopt;  // read() reports it
  return parent_->map_read(offset_ + off, len);
}

Task<Status> WindowDriver::write(uint64_t off, std::span<const std::byte> buf) {
  QCOWFS_CO_TRY(check_range(off, buf.size()));
  co_return co_await parent_->write(offset_ + off, buf);
}

Task<Status> WindowDriver::flush() { co_return co_await parent_->flush(); }

Task<Status> WindowDriver::discard(uint64_t off, uint64_t len) {
  QCOWFS_CO_TRY(check_range(off, len));
  co_return co_await parent_->discard(offset_ + off, len);
}

Task<Status> WindowDriver::write_zeroes(uint64_t off, uint64_t len, bool may_unmap) {
  QCOWFS_CO_TRY(check_range(off, len));
  co_return co_await parent_->write_zeroes(offset_ + off, len, may_unmap);
}

Task<Status> WindowDriver::truncate(uint64_t) {
  co_return Status::error(EINVAL, "a partition window has a fixed size");
}

Task<Result<BlockStatus>> WindowDriver::block_status(uint64_t off, uint64_t len) {
  QCOWFS_CO_TRY(check_range(off, len));
  auto st = co_await parent_->block_status(offset_ + off, std::min(len, size_ - off));
  if (st && st->length > size_ - off) st->length = size_ - off;
  co_return st;
}

Task<Status> WindowDriver::close() {
  if (read_only()) co_return Status::ok();
  co_return co_await parent_->flush();
}

}  // namespace qcowfs::image
