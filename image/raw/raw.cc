#include "image/raw/raw.h"

#include <algorithm>
#include <cstring>

#include "image/shrink.h"

namespace qcowfs::image {

RawDriver::RawDriver(std::unique_ptr<io::HostFile> file, bool discard_unmap, uint64_t offset,
                     std::optional<uint64_t> size)
    : owned_(std::move(file)), file_(owned_.get()), discard_unmap_(discard_unmap), offset_(offset),
      window_size_(size) {}

RawDriver::RawDriver(io::HostFile* file, bool discard_unmap, uint64_t offset, std::optional<uint64_t> size)
    : file_(file), discard_unmap_(discard_unmap), offset_(offset), window_size_(size) {}

uint64_t RawDriver::size() const {
  if (window_size_) return *window_size_;
  uint64_t s = file_->size();
  return s > offset_ ? s - offset_ : 0;
}

io::HostFile* RawDriver::identity_file() {
  if (offset_ != 0 || window_size_ || file_->is_block_device()) return nullptr;
  return file_;
}

Task<Status> RawDriver::read(uint64_t off, std::span<std::byte> buf) {
  auto n = co_await file_->read(offset_ + off, buf);
  if (!n) co_return n.status();
  // A window may reach past the end of a shorter host file: that part reads as zeros.
  if (*n < buf.size()) std::memset(buf.data() + *n, 0, buf.size() - *n);
  co_return Status::ok();
}

Task<Status> RawDriver::write(uint64_t off, std::span<const std::byte> buf) {
  if (read_only()) co_return Status::error(EROFS, "image is read-only");
  co_return co_await file_->write(offset_ + off, buf);
}

Task<Status> RawDriver::flush() { co_return co_await file_->flush(); }

Task<Status> RawDriver::discard(uint64_t off, uint64_t len) {
  if (read_only()) co_return Status::error(EROFS, "image is read-only");
  if (!discard_unmap_) co_return Status::ok();  // discard=ignore: a hint we may drop
  co_return co_await file_->discard(offset_ + off, len);
}

Task<Status> RawDriver::write_zeroes(uint64_t off, uint64_t len, bool may_unmap) {
  if (read_only()) co_return Status::error(EROFS, "image is read-only");
  // Punching keeps reads zero on regular files; devices need an explicit zero-out.
  if (may_unmap && discard_unmap_ && !file_->is_block_device())
    co_return co_await file_->discard(offset_ + off, len);
  co_return co_await file_->write_zeroes(offset_ + off, len);
}

Task<Status> RawDriver::truncate(uint64_t new_size) {
  if (read_only()) co_return Status::error(EROFS, "image is read-only");
  if (window_size_ || offset_ != 0 || file_->is_block_device())
    co_return Status::error(EINVAL, "a raw device or window has a fixed size");
  if (new_size < size()) QCOWFS_CO_TRY(co_await check_shrink(*this, new_size));
  co_return co_await file_->truncate(new_size);
}

// Like qemu's file driver: holes read as zeros and data as data, both present
// at their host offset. A window reaching past the end of the file reads as
// zeros there.
Task<Result<BlockStatus>> RawDriver::block_status(uint64_t off, uint64_t len) {
  uint64_t host = offset_ + off;
  BlockStatus st;
  st.present = true;
  st.file = file_;
  st.host_offset = host;
  uint64_t end = file_->size();
  if (host >= end) {
    st.length = len;
    st.zero = true;
    co_return st;
  }
  auto data = co_await file_->seek_data(host);
  if (!data) co_return data.status();
  if (*data > host) {  // in a hole: reads as zeros, nothing stored
    st.length = *data >= end ? len : std::min(len, *data - host);
    st.zero = true;
    co_return st;
  }
  auto hole = co_await file_->seek_hole(host);
  if (!hole) co_return hole.status();
  st.length = std::min(len, *hole > host ? *hole - host : len);
  st.data = true;
  co_return st;
}

Task<Status> RawDriver::close() {
  if (read_only()) co_return Status::ok();
  co_return co_await file_->flush();
}

Task<Status> create_raw(io::HostFile& file, uint64_t size, bool allocate) {
  QCOWFS_CO_TRY(co_await file.truncate(size));
  if (allocate) QCOWFS_CO_TRY(co_await file.write_zeroes(0, size));
  co_return co_await file.flush();
}

ImageDetails RawDriver::details() const {
  ImageDetails d;
  d.dirty = false;
  return d;
}

Task<Result<std::unique_ptr<BlockDriver>>> open_raw(std::unique_ptr<io::HostFile> file, std::string path,
                                                    ImageOptions opts) {
  if (!opts.snapshot.empty()) co_return Status::errorf(EINVAL, "{}: raw images have no snapshots", path);
  std::unique_ptr<BlockDriver> d = std::make_unique<RawDriver>(std::move(file), opts.discard_unmap);
  co_return d;
}

}  // namespace qcowfs::image
