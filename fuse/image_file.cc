#include "fuse/image_file.h"

#include "fuse/passthrough.h"
#include "io/buffer.h"
#include "io/log.h"

namespace qcowfs::fuse {

ImageFile::ImageFile(image::BlockDriver* driver, bool writable) : writable_(writable), driver_(driver) {}

ImageFile::ImageFile(std::unique_ptr<image::BlockDriver> view) : owned_(std::move(view)), driver_(owned_.get()) {}

ImageFile::ImageFile(image::BlockDriver* parent, std::string snapshot_id, uint64_t snapshot_size)
    : parent_(parent), snapshot_id_(std::move(snapshot_id)), snapshot_size_(snapshot_size) {}

ImageFile::ImageFile(Opener opener, bool writable) : writable_(writable), opener_(std::move(opener)) {}

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
  if (counts_users()) {
    std::lock_guard lk(mu_);
    auto* d = driver();
    return d ? d->size() : closed_size_;
  }
  auto* d = driver();
  return d ? d->size() : snapshot_size_;
}

uint64_t ImageFile::allocated_bytes() const {
  if (counts_users()) {
    std::lock_guard lk(mu_);
    auto* d = driver();
    return d ? d->allocated_bytes() : closed_allocated_;
  }
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

bool ImageFile::try_acquire() {
  std::lock_guard lk(mu_);
  if (!driver()) return false;
  ++users_;
  return true;
}

Task<Status> ImageFile::acquire() {
  if (try_acquire()) co_return Status::ok();
  auto guard = co_await open_mu_.lock();
  if (try_acquire()) co_return Status::ok();  // opened while we waited
  auto opened = co_await opener_();
  if (!opened) co_return opened.status();
  owned_ = std::move(*opened);
  std::lock_guard lk(mu_);
  driver_.store(owned_.get(), std::memory_order_release);
  ++users_;
  co_return Status::ok();
}

void ImageFile::release() {
  {
    std::lock_guard lk(mu_);
    if (users_ == 0 || --users_ > 0) return;
    last_release_ = Clock::now();
  }
  if (on_idle_) on_idle_();
}

bool ImageFile::is_open() const {
  std::lock_guard lk(mu_);
  return driver() != nullptr;
}

void ImageFile::set_closed_attributes(uint64_t size, uint64_t allocated) {
  std::lock_guard lk(mu_);
  closed_size_ = size;
  closed_allocated_ = allocated;
}

Task<Result<std::optional<ImageFile::Clock::time_point>>> ImageFile::close_if_idle(Clock::time_point now,
                                                                                   Clock::duration delay) {
  auto guard = co_await open_mu_.lock();
  {
    std::lock_guard lk(mu_);
    if (!owned_ || users_ > 0) co_return std::nullopt;
    if (now - last_release_ < delay) co_return std::optional(last_release_ + delay);
    // From here no new user can find the driver: acquire() waits for open_mu_.
    unpublish_locked();
  }
  Status st = co_await close_unpublished();
  if (!st) co_return st;
  co_return std::nullopt;
}

void ImageFile::unpublish_locked() {
  closed_size_ = owned_->size();
  closed_allocated_ = owned_->allocated_bytes();
  driver_.store(nullptr, std::memory_order_release);
}

Task<Status> ImageFile::close_unpublished() {
  Status st = co_await owned_->close();
  owned_.reset();
  co_return st;
}

Task<Result<bool>> ImageFile::close_if_unused() {
  if (!open_mu_.try_lock()) co_return false;  // an open is under way
  io::AsyncMutex::Guard guard(&open_mu_);
  {
    std::lock_guard lk(mu_);
    if (users_ > 0) co_return false;
    if (!owned_) co_return true;
    unpublish_locked();
  }
  Status st = co_await close_unpublished();
  if (!st) co_return st;
  co_return true;
}

Task<Status> ImageFile::close() {
  if (!owned_) co_return Status::ok();
  Status st = co_await owned_->close();
  driver_.store(nullptr, std::memory_order_release);
  owned_.reset();
  co_return st;
}

}  // namespace qcowfs::fuse
