// ThreadEngine: the Engine for hosts without io_uring (disabled by sysctl,
// filtered by seccomp, old kernels). run_once() hands the queued requests to
// ThreadPool::shared(), whose workers run the blocking syscall (pread, pwritev,
// fdatasync, fallocate, ...) and post the completion back; it then waits in
// ppoll(2) on the mailbox eventfd plus the fds of pending Op::poll_in requests,
// no longer than until the first pending Op::timeout is due. Op::poll_in
// ignores poll_exclusive (ppoll has no exclusive waiters); cancel() ends
// queued, polling and timer requests, not those running on a worker.
//
// Thread-safety: as Engine: only post() may be called from other threads.
#pragma once

#include <poll.h>

#include <chrono>
#include <memory>
#include <vector>

#include "io/engine.h"
#include "io/mailbox.h"

namespace qcowfs::io {

class ThreadEngine final : public Engine {
 public:
  static Result<std::unique_ptr<ThreadEngine>> create();
  explicit ThreadEngine(std::shared_ptr<Mailbox> mailbox) : mailbox_(std::move(mailbox)) {}
  ~ThreadEngine() override;

  void enqueue(IoRequest* req) override;
  void run_once(int timeout_ms) override;
  void post(std::function<void()> fn) override;
  void cancel(IoRequest* req) override;
  std::string_view name() const override { return "threads"; }

 private:
  void submit_queued();
  void wait(int timeout_ms);
  void expire_timers();
  void run_posted();

  using Clock = std::chrono::steady_clock;
  struct Timer {
    Clock::time_point due;
    IoRequest* req;
  };

  std::shared_ptr<Mailbox> mailbox_;
  std::vector<IoRequest*> queued_;   // enqueued since the last run_once
  std::vector<IoRequest*> polling_;  // Op::poll_in requests waiting for readability
  std::vector<Timer> timers_;        // Op::timeout requests not yet due
  std::vector<IoRequest*> ready_;    // poll_in requests that fired, timers that ran out, cancelled ones
  std::vector<IoRequest*> finishing_; // ready_ of the round being finished (kept for its capacity)
  std::vector<pollfd> pollfds_;      // wait()'s poll set, kept for its capacity
};

// Runs one request's syscall synchronously on the calling thread, retrying
// EINTR/EAGAIN. Returns bytes (or 0) on success, -errno on failure.
int64_t execute_blocking(const IoRequest& req);

}  // namespace qcowfs::io
