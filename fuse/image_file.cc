#include "fuse/image_file.h"

#include "fuse/passthrough.h"
#include "io/buffer.h"
#include "io/log.h"

namespace qcowfs::fuse {

ImageFile::ImageFile(image::BlockDriver* driver, bool writable) : writable_(writable), driver_(driver) {}

ImageFile::ImageFile(image::BlockDriver* parent, std::string snapshot_id, uint64_t snapshot_size)
    : parent_(parent), snapshot_id_(std::move(snapshot_id)), snapshot_size_(snapshot_size) {}

Task<Status> ImageFile::ensure_open() {
  if (driver()) co_return Status::ok();
  auto guard = co_await open_mu_.lock();
  if (driver()) co_return Status::ok();
  auto opened = co_await parent_->open_snapshot(snapshot_id_);
  if (!opened) co_return opened.status().with_context(fmt::format("opening snapshot {}", snapshot_id_));
  owned_ = std::move(*opened);
  driver_.store(owned_.get(), std::memory_order_release);
  co_return Status::ok();
}

uint64_t ImageFile::size() const {
  auto* d = driver();
  return d ? d->size() : snapshot_size_;
}

uint64_t ImageFile::allocated_bytes() const {
  auto* d = driver();
  return d ? d->allocated_bytes() : 0;
}

uint64_t ImageFile::mem_align() const {
  auto* d = driver();
  return d ? d->mem_align() : io::kMinMemAlign;
}

io::HostFile* ImageFile::passthrough_file() const {
  auto* d = driver();
  io::HostFile* f = d && !parent_ && !writable_ ? d->identity_file() : nullptr;
  if (!f) return nullptr;
  const size_t align = f->direct_io_align();
  return align != 0 && align <= passthrough::kMaxDirectAlign ? f : nullptr;
}

Task<Status> ImageFile::close() {
  if (!owned_) co_return Status::ok();
  Status st = co_await owned_->close();
  driver_.store(nullptr, std::memory_order_release);
  owned_.reset();
  co_return st;
}

}  // namespace qcowfs::fuse
