#include "io/thread_engine.h"

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <ctime>

#include "io/thread_pool.h"

namespace qcowfs::io {
namespace {

int64_t execute_once(const IoRequest& req) {
  using Op = IoRequest::Op;
  const auto off = static_cast<off_t>(req.offset);
  const int iovcnt = static_cast<int>(req.iovcnt);
  ssize_t r = 0;
  switch (req.op) {
    case Op::read: r = ::pread(req.fd, req.buf, req.length, off); break;
    case Op::write: r = ::pwrite(req.fd, req.buf, req.length, off); break;
    case Op::readv: r = ::preadv(req.fd, req.iov, iovcnt, off); break;
    case Op::writev: r = ::pwritev(req.fd, req.iov, iovcnt, off); break;
    case Op::fsync: r = ::fsync(req.fd); break;
    case Op::fdatasync: r = ::fdatasync(req.fd); break;
    case Op::fallocate: r = ::fallocate(req.fd, req.mode, off, static_cast<off_t>(req.length)); break;
    case Op::poll_in: {
      pollfd p{req.fd, POLLIN, 0};
      r = ::poll(&p, 1, -1);
      if (r > 0) r = p.revents;
      break;
    }
    case Op::call: break;  // handled by execute_blocking
    case Op::uring_cmd:
    case Op::read_ready: return -EOPNOTSUPP;  // io_uring only
    case Op::timeout: break;                 // a timer of the engine (ThreadEngine::wait)
  }
  return r < 0 ? -errno : r;
}

}  // namespace

int64_t execute_blocking(const IoRequest& req) {
  if (req.op == IoRequest::Op::call) return req.call();  // its result is the caller's business
  for (;;) {
    int64_t r = execute_once(req);
    if (r != -EINTR && r != -EAGAIN) return r;
  }
}

Result<std::unique_ptr<ThreadEngine>> ThreadEngine::create() {
  auto mailbox = Mailbox::create();
  if (!mailbox) return mailbox.status();
  return std::make_unique<ThreadEngine>(std::move(*mailbox));
}

ThreadEngine::~ThreadEngine() { mailbox_->close(); }

void ThreadEngine::enqueue(IoRequest* req) { queued_.push_back(req); }

void ThreadEngine::post(std::function<void()> fn) {
  mailbox_->post(std::move(fn), Engine::current() == this);
}

void ThreadEngine::run_once(int timeout_ms) {
  submit_queued();
  wait(mailbox_->has_work() || !ready_.empty() ? 0 : timeout_ms);
  // finish() may enqueue or cancel: those land in queued_/ready_ for the next round.
  finishing_.swap(ready_);
  for (IoRequest* req : finishing_) req->finish();
  finishing_.clear();
  run_posted();
}

void ThreadEngine::cancel(IoRequest* req) {
  auto settle = [this, req] {
    req->result = -ECANCELED;
    ready_.push_back(req);
  };
  if (auto it = std::find(queued_.begin(), queued_.end(), req); it != queued_.end()) {
    queued_.erase(it);
    settle();
  } else if (auto p = std::find(polling_.begin(), polling_.end(), req); p != polling_.end()) {
    polling_.erase(p);
    settle();
  } else if (auto t = std::find_if(timers_.begin(), timers_.end(), [req](const Timer& x) { return x.req == req; });
             t != timers_.end()) {
    timers_.erase(t);
    settle();
  }
}

void ThreadEngine::submit_queued() {
  for (IoRequest* req : queued_) {
    if (req->op == IoRequest::Op::poll_in) {
      polling_.push_back(req);
      continue;
    }
    if (req->op == IoRequest::Op::timeout) {
      const auto* ts = static_cast<const Timespec*>(req->buf);
      const auto d = std::chrono::seconds(ts->tv_sec) + std::chrono::nanoseconds(ts->tv_nsec);
      timers_.push_back(Timer{Clock::now() + std::chrono::duration_cast<Clock::duration>(d), req});
      continue;
    }
    ThreadPool::shared().submit([mailbox = mailbox_, req] {
      int64_t r = execute_blocking(*req);
      mailbox->post(
          [req, r] {
            req->result = r;
            req->finish();
          },
          false);
    });
  }
  queued_.clear();
}

// ppoll(2) on the mailbox eventfd and every pending poll_in fd, no longer
// than until the first timer is due; fired poll_in requests move to ready_
// with their revents as result, timers that ran out with 0.
void ThreadEngine::wait(int timeout_ms) {
  std::vector<pollfd>& fds = pollfds_;
  fds.clear();
  fds.push_back(pollfd{mailbox_->fd(), POLLIN, 0});
  for (IoRequest* req : polling_) fds.push_back(pollfd{req->fd, POLLIN, 0});
  auto wait_for = std::chrono::nanoseconds(std::chrono::milliseconds(timeout_ms));
  if (!timers_.empty()) {
    const auto first = std::min_element(timers_.begin(), timers_.end(),
                                         [](const Timer& a, const Timer& b) { return a.due < b.due; });
    const auto until = std::max(Clock::duration::zero(), first->due - Clock::now());
    if (timeout_ms < 0 || until < wait_for) wait_for = until;
  }
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(wait_for.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(wait_for.count() % 1000000000);
  const bool forever = timeout_ms < 0 && timers_.empty();
  int n = ::ppoll(fds.data(), fds.size(), forever ? nullptr : &ts, nullptr);
  expire_timers();
  if (n <= 0) return;  // timeout or EINTR
  if (fds[0].revents) mailbox_->drain_wakeups();
  size_t keep = 0;
  for (size_t i = 0; i < polling_.size(); ++i) {
    IoRequest* req = polling_[i];
    short revents = fds[i + 1].revents;
    if (revents) {
      req->result = revents & POLLNVAL ? -EBADF : revents;
      ready_.push_back(req);
    } else {
      polling_[keep++] = req;
    }
  }
  polling_.resize(keep);
}

void ThreadEngine::expire_timers() {
  if (timers_.empty()) return;
  const Clock::time_point now = Clock::now();
  size_t keep = 0;
  for (const Timer& t : timers_) {
    if (t.due <= now) {
      t.req->result = 0;
      ready_.push_back(t.req);
    } else {
      timers_[keep++] = t;
    }
  }
  timers_.resize(keep);
}

void ThreadEngine::run_posted() {
  for (auto& fn : mailbox_->take()) fn();
}

}  // namespace qcowfs::io
