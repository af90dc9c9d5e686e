#include "io/mailbox.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cstdint>

namespace qcowfs::io {

Result<std::shared_ptr<Mailbox>> Mailbox::create() {
  int fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (fd < 0) return Status::from_errno(errno, "eventfd");
  return std::make_shared<Mailbox>(UniqueFd(fd));
}

void Mailbox::post(std::function<void()> fn, bool from_owner) {
  bool write_needed = false;
  {
    std::lock_guard lk(mu_);
    if (closed_) return;
    queue_.push_back(std::move(fn));
    if (!from_owner && !wake_pending_) {
      wake_pending_ = true;
      write_needed = true;
    }
  }
  if (write_needed) {
    uint64_t one = 1;
    // Cannot fail short of a full counter, which draining prevents.
    ssize_t ignored = ::write(efd_.get(), &one, sizeof(one));
    (void)ignored;
  }
}

bool Mailbox::has_work() {
  std::lock_guard lk(mu_);
  return !queue_.empty();
}

std::deque<std::function<void()>> Mailbox::take() {
  std::deque<std::function<void()>> out;
  std::lock_guard lk(mu_);
  out.swap(queue_);
  wake_pending_ = false;
  return out;
}

void Mailbox::drain_wakeups() {
  uint64_t v;
  while (::read(efd_.get(), &v, sizeof(v)) == static_cast<ssize_t>(sizeof(v))) {
  }
}

void Mailbox::close() {
  std::lock_guard lk(mu_);
  closed_ = true;
  queue_.clear();
}

}  // namespace qcowfs::io
