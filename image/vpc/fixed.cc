#include "image/vpc/fixed.h"

#include <algorithm>
#include <cstring>

namespace qcowfs::image::vpc {
namespace {

Status refuse_write() { return Status::error(EROFS, "the vpc image is open read-only"); }

}  // namespace

FixedDriver::FixedDriver(std::unique_ptr<io::HostFile> file, uint64_t size, ImageDetails details)
    : file_(std::move(file)), size_(size), details_(std::move(details)) {}

Task<Status> FixedDriver::read(uint64_t off, std::span<std::byte> buf) {
  auto n = co_await file_->read(off, buf);
  if (!n) co_return n.status();
  if (*n < buf.size()) std::memset(buf.data() + *n, 0, buf.size() - *n);
  co_return Status::ok();
}

// Every range is data at its own offset; the file's holes, and whatever lies
// past its end, are zero too.
Task<Result<BlockStatus>> FixedDriver::block_status(uint64_t off, uint64_t len) {
  BlockStatus st;
  st.present = true;
  st.data = true;
  st.file = file_.get();
  st.host_offset = off;
  st.length = len;
  const uint64_t end = file_->size();
  if (off >= end) {
    st.zero = true;
    co_return st;
  }
  auto data = co_await file_->seek_data(off);
  if (!data) co_return data.status();
  if (*data > off) {
    st.zero = true;
    if (*data < end) st.length = std::min(len, *data - off);
    co_return st;
  }
  auto hole = co_await file_->seek_hole(off);
  if (!hole) co_return hole.status();
  if (*hole > off) st.length = std::min(len, *hole - off);
  co_return st;
}

Task<Status> FixedDriver::write(uint64_t, std::span<const std::byte>) { co_return refuse_write(); }
Task<Status> FixedDriver::flush() { co_return Status::ok(); }
Task<Status> FixedDriver::discard(uint64_t, uint64_t) { co_return refuse_write(); }
Task<Status> FixedDriver::write_zeroes(uint64_t, uint64_t, bool) { co_return refuse_write(); }
Task<Status> FixedDriver::truncate(uint64_t) { co_return refuse_write(); }
Task<Status> FixedDriver::close() { co_return Status::ok(); }

}  // namespace qcowfs::image::vpc
