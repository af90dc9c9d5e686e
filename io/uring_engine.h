// UringEngine: the io_uring Engine. enqueue() only fills SQEs; run_once()
// submits all of them and waits in one io_uring_enter, then reaps every CQE,
// resumes the completed requests' coroutines and runs posted functions.
// Cross-thread post() goes through a Mailbox whose eventfd the ring polls (a
// poll SQE stays armed on it). cancel() queues an IORING_OP_ASYNC_CANCEL keyed
// by the request's address (its user_data). Op::call runs on ThreadPool::shared() and
// completes through post().
//
// The ring is created disabled and enabled on first use, so the thread that
// drives it (not the one that created it) becomes its single issuer; that
// allows IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN on kernels
// that have them, with a fall back to plain rings on older kernels.
//
// Thread-safety: as Engine: only post() may be called from other threads.
#pragma once

#include <liburing.h>

#include <deque>
#include <memory>
#include <vector>

#include "io/engine.h"
#include "io/mailbox.h"

namespace qcowfs::io {

class UringEngine final : public Engine {
 public:
  // Fails (carrying io_uring_queue_init's errno) when io_uring is unavailable.
  // uring_cmd: ask for 128-byte SQEs (see EngineFeatures); kernels without
  // them get a plain ring on which supports_uring_cmd() is false.
  static Result<std::unique_ptr<UringEngine>> create(unsigned queue_depth, bool uring_cmd = false);
  ~UringEngine() override;

  void enqueue(IoRequest* req) override;
  void run_once(int timeout_ms) override;
  void post(std::function<void()> fn) override;
  void cancel(IoRequest* req) override;
  std::string_view name() const override { return "io_uring"; }
  bool supports_uring_cmd() const override { return (setup_flags_ & IORING_SETUP_SQE128) != 0; }
  bool submits_inline() const override { return true; }

 private:
  UringEngine(std::shared_ptr<Mailbox> mailbox, const io_uring& ring, unsigned setup_flags);
  void start_on_this_thread();
  bool try_prepare_read_ready(IoRequest* req);
  bool try_prepare(IoRequest* req);
  void prepare_sqe(io_uring_sqe* sqe, IoRequest* req);
  void prepare_uring_cmd(io_uring_sqe* sqe, const IoRequest* req);
  void arm_wakeup_poll();
  io_uring_sqe* get_sqe();
  void refill_from_backlog();
  void wait(int timeout_ms);
  void reap();
  void complete(IoRequest* req, int res);
  void run_posted();
  void start_call(IoRequest* req);

  std::shared_ptr<Mailbox> mailbox_;
  io_uring ring_;
  unsigned setup_flags_;
  bool started_ = false;
  bool wakeup_armed_ = false;
  std::deque<IoRequest*> backlog_;   // requests that found the SQ full twice
  std::vector<IoRequest*> done_;     // reaped this round, resumed after the CQ advance
  std::vector<IoRequest*> resuming_; // done_ of the round being resumed (kept for its capacity)
  size_t resumed_ = 0;               // how many of resuming_ have been resumed
  std::vector<IoRequest*> cancels_;  // requests to cancel that found no SQE (rare)
};

}  // namespace qcowfs::io
