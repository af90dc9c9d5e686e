#include "io/uring_engine.h"

#include <poll.h>
#include <sys/epoll.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstddef>
#include <cstring>

#include "io/log.h"
#include "io/thread_pool.h"

namespace qcowfs::io {
namespace {

// Tags CQEs of the mailbox eventfd poll; requests are tagged with their
// (aligned, so never 1) address.
constexpr uint64_t kWakeupTag = 1;
// Tags CQEs of cancel() requests (their target completes on its own CQE).
constexpr uint64_t kCancelTag = 2;
// Op::read_ready's POLL_ADD carries its request's address with this bit set
// (requests are 8-byte aligned). Its CQE only records a failure: the request
// completes on its READ's CQE, -ECANCELED when the poll failed. (Not
// IOSQE_CQE_SKIP_SUCCESS: with it a failed head also hides its links' CQEs,
// so whether the read's ever comes would depend on the kernel.)
constexpr uint64_t kLinkedPollBit = 4;
static_assert(alignof(IoRequest) >= 8);
// The kernel transfers at most this much per read/write call (MAX_RW_COUNT);
// longer requests simply complete short and HostFile continues them.
constexpr uint64_t kMaxRwCount = INT_MAX & ~uint64_t{4095};

constexpr unsigned kPollInExclusive = unsigned{POLLIN} | static_cast<unsigned>(EPOLLEXCLUSIVE);

unsigned clamp_len(uint64_t len) { return static_cast<unsigned>(std::min(len, kMaxRwCount)); }

// Op::timeout hands the ring its Timespec as the kernel's own type.
static_assert(sizeof(Timespec) == sizeof(__kernel_timespec));
static_assert(offsetof(Timespec, tv_nsec) == offsetof(__kernel_timespec, tv_nsec));

// Tries the fastest setup first; older kernels reject unknown flags with EINVAL.
// With extra = IORING_SETUP_SQE128 every candidate is tried with it first.
int init_ring(unsigned depth, unsigned extra, io_uring* ring, unsigned* flags_out) {
  const unsigned fast = IORING_SETUP_R_DISABLED | IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN;
  const unsigned coop = IORING_SETUP_COOP_TASKRUN | IORING_SETUP_TASKRUN_FLAG;
  const unsigned candidates[] = {fast | extra, coop | extra, extra, fast, coop, 0};
  int r = -EINVAL;
  for (unsigned flags : candidates) {
    io_uring_params p{};
    p.flags = flags;
    r = io_uring_queue_init_params(depth, ring, &p);
    if (r == 0) {
      *flags_out = flags;
      return 0;
    }
    if (r != -EINVAL) return r;
  }
  return r;
}

}  // namespace

Result<std::unique_ptr<UringEngine>> UringEngine::create(unsigned queue_depth, bool uring_cmd) {
  auto mailbox = Mailbox::create();
  if (!mailbox) return mailbox.status();
  io_uring ring;
  unsigned flags = 0;
  int r = init_ring(std::clamp(queue_depth, 8u, 4096u), uring_cmd ? IORING_SETUP_SQE128 : 0u, &ring, &flags);
  if (r < 0) return Status::from_errno(-r, "io_uring_queue_init");
  return std::unique_ptr<UringEngine>(new UringEngine(std::move(*mailbox), ring, flags));
}

UringEngine::UringEngine(std::shared_ptr<Mailbox> mailbox, const io_uring& ring, unsigned setup_flags)
    : mailbox_(std::move(mailbox)), ring_(ring), setup_flags_(setup_flags) {}

UringEngine::~UringEngine() {
  mailbox_->close();
  io_uring_queue_exit(&ring_);
}

// The first call from the driving thread: enabling a disabled ring makes this
// thread its single issuer; registering the ring fd saves an fd lookup per enter.
void UringEngine::start_on_this_thread() {
  if (started_) return;
  started_ = true;
  if (setup_flags_ & IORING_SETUP_R_DISABLED) {
    // liburing 2.3 declares io_uring_enable_rings() but does not export it.
    long r = ::syscall(__NR_io_uring_register, ring_.ring_fd, IORING_REGISTER_ENABLE_RINGS, nullptr, 0);
    if (r < 0) log::error("{}", Status::from_errno(errno, "enabling io_uring").to_string());
  }
  io_uring_register_ring_fd(&ring_);  // optional speed-up; failure is harmless
  arm_wakeup_poll();
}

void UringEngine::arm_wakeup_poll() {
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
  if (!sqe) {
    io_uring_submit(&ring_);
    sqe = io_uring_get_sqe(&ring_);
  }
  if (!sqe) return;  // retried after the next reap
  io_uring_prep_poll_add(sqe, mailbox_->fd(), POLLIN);
  io_uring_sqe_set_data64(sqe, kWakeupTag);
  wakeup_armed_ = true;
}

void UringEngine::enqueue(IoRequest* req) {
  if (req->op == IoRequest::Op::call) {
    start_call(req);
    return;
  }
  if (req->op == IoRequest::Op::uring_cmd && !supports_uring_cmd()) {
    req->result = -EOPNOTSUPP;
    done_.push_back(req);  // resumed by the next run_once(), never inline
    return;
  }
  if (!backlog_.empty() || !try_prepare(req)) backlog_.push_back(req);
}

io_uring_sqe* UringEngine::get_sqe() {
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
  if (!sqe && started_) {  // SQ full: push what is queued to the kernel, then retry
    io_uring_submit(&ring_);
    sqe = io_uring_get_sqe(&ring_);
  }
  return sqe;
}

bool UringEngine::try_prepare(IoRequest* req) {
  if (req->op == IoRequest::Op::read_ready) return try_prepare_read_ready(req);
  io_uring_sqe* sqe = get_sqe();
  if (!sqe) return false;
  prepare_sqe(sqe, req);
  return true;
}

// Two SQEs, both or neither: the poll, linked to the read. The poll's CQE
// (tagged) keeps its result in req->result until the read's CQE arrives (see
// reap() and complete()).
bool UringEngine::try_prepare_read_ready(IoRequest* req) {
  if (io_uring_sq_space_left(&ring_) < 2) {
    if (!started_) return false;
    io_uring_submit(&ring_);
    if (io_uring_sq_space_left(&ring_) < 2) return false;
  }
  io_uring_sqe* poll = io_uring_get_sqe(&ring_);
  io_uring_prep_poll_add(poll, req->fd, req->poll_exclusive ? kPollInExclusive : unsigned{POLLIN});
  io_uring_sqe_set_flags(poll, IOSQE_IO_LINK);
  io_uring_sqe_set_data64(poll, reinterpret_cast<uint64_t>(req) | kLinkedPollBit);
  io_uring_sqe* read = io_uring_get_sqe(&ring_);
  io_uring_prep_read(read, req->fd, req->buf, clamp_len(req->length), ~uint64_t{0});  // at the file position
  io_uring_sqe_set_data(read, req);
  req->result = 0;
  return true;
}

// Not yet in the kernel (backlog) or completed but not yet resumed: settled
// here. Otherwise an ASYNC_CANCEL keyed by the request's user_data; if the
// request completes first, the cancel finds nothing (-ENOENT, ignored).
void UringEngine::cancel(IoRequest* req) {
  if (auto it = std::find(backlog_.begin(), backlog_.end(), req); it != backlog_.end()) {
    backlog_.erase(it);
    req->result = -ECANCELED;
    done_.push_back(req);
    return;
  }
  if (std::find(done_.begin(), done_.end(), req) != done_.end()) return;
  if (std::find(resuming_.begin() + static_cast<ptrdiff_t>(resumed_), resuming_.end(), req) != resuming_.end())
    return;
  io_uring_sqe* sqe = get_sqe();
  if (!sqe) {
    cancels_.push_back(req);  // retried by the next run_once()
    return;
  }
  io_uring_prep_cancel(sqe, req, 0);
  io_uring_sqe_set_data64(sqe, kCancelTag);
  // A read_ready waits in its poll (cancelling that fails the linked read), or
  // its read waits for data on a file io_uring polls by itself (cancelled above).
  if (req->op == IoRequest::Op::read_ready) {
    io_uring_sqe* poll = get_sqe();
    if (!poll) {
      cancels_.push_back(req);
      return;
    }
    io_uring_prep_cancel64(poll, reinterpret_cast<uint64_t>(req) | kLinkedPollBit, 0);
    io_uring_sqe_set_data64(poll, kCancelTag);
  }
}

void UringEngine::prepare_sqe(io_uring_sqe* sqe, IoRequest* req) {
  using Op = IoRequest::Op;
  switch (req->op) {
    case Op::read: io_uring_prep_read(sqe, req->fd, req->buf, clamp_len(req->length), req->offset); break;
    case Op::write: io_uring_prep_write(sqe, req->fd, req->buf, clamp_len(req->length), req->offset); break;
    case Op::readv: io_uring_prep_readv(sqe, req->fd, req->iov, req->iovcnt, req->offset); break;
    case Op::writev: io_uring_prep_writev(sqe, req->fd, req->iov, req->iovcnt, req->offset); break;
    case Op::fsync: io_uring_prep_fsync(sqe, req->fd, 0); break;
    case Op::fdatasync: io_uring_prep_fsync(sqe, req->fd, IORING_FSYNC_DATASYNC); break;
    case Op::fallocate:
      io_uring_prep_fallocate(sqe, req->fd, req->mode, static_cast<off_t>(req->offset),
                              static_cast<off_t>(req->length));
      break;
    case Op::poll_in:
      // EPOLLEXCLUSIVE: io_uring queues the waiter with add_wait_queue_exclusive().
      io_uring_prep_poll_add(sqe, req->fd, req->poll_exclusive ? kPollInExclusive : unsigned{POLLIN});
      break;
    case Op::uring_cmd: prepare_uring_cmd(sqe, req); break;
    case Op::timeout: io_uring_prep_timeout(sqe, static_cast<__kernel_timespec*>(req->buf), 0, 0); break;
    case Op::call: break;        // never reaches the ring (see enqueue)
    case Op::read_ready: break;  // two SQEs (see try_prepare_read_ready)
  }
  io_uring_sqe_set_data(sqe, req);
}

// The 128-byte SQE's second half is the command area; it is filled whole
// (zero padded) because the ring reuses SQE slots.
void UringEngine::prepare_uring_cmd(io_uring_sqe* sqe, const IoRequest* req) {
  std::memset(sqe, 0, 2 * sizeof(io_uring_sqe));
  sqe->opcode = IORING_OP_URING_CMD;
  sqe->fd = req->fd;
  sqe->cmd_op = req->cmd_op;
  sqe->addr = reinterpret_cast<uint64_t>(req->iov);
  sqe->len = req->iovcnt;
  std::memcpy(sqe->cmd, req->buf, std::min<uint64_t>(req->length, kUringCmdBytes));
}

void UringEngine::start_call(IoRequest* req) {
  ThreadPool::shared().submit([mailbox = mailbox_, req] {
    int64_t r = req->call();
    mailbox->post(
        [req, r] {
          req->result = r;
          req->finish();
        },
        false);
  });
}

void UringEngine::post(std::function<void()> fn) {
  mailbox_->post(std::move(fn), Engine::current() == this);
}

void UringEngine::run_once(int timeout_ms) {
  start_on_this_thread();
  refill_from_backlog();
  if (!cancels_.empty()) {
    std::vector<IoRequest*> retry;
    retry.swap(cancels_);
    for (IoRequest* req : retry) cancel(req);
  }
  if (!wakeup_armed_) arm_wakeup_poll();
  wait(mailbox_->has_work() || !done_.empty() ? 0 : timeout_ms);
  reap();
  run_posted();
}

void UringEngine::refill_from_backlog() {
  while (!backlog_.empty() && try_prepare(backlog_.front())) backlog_.pop_front();
}

// One io_uring_enter: submits everything queued and waits for a completion.
// -ETIME (timeout), -EINTR (signal) and -EBUSY (CQ overflow backlog; the reap
// below makes room) all just end the wait.
void UringEngine::wait(int timeout_ms) {
  if (timeout_ms == 0) {
    io_uring_submit_and_get_events(&ring_);
  } else if (timeout_ms < 0) {
    io_uring_submit_and_wait(&ring_, 1);
  } else {
    __kernel_timespec ts{};
    ts.tv_sec = timeout_ms / 1000;
    ts.tv_nsec = static_cast<long long>(timeout_ms % 1000) * 1000000;
    io_uring_cqe* cqe = nullptr;
    io_uring_submit_and_wait_timeout(&ring_, &cqe, 1, &ts, nullptr);
  }
}

void UringEngine::reap() {
  unsigned head;
  unsigned seen = 0;
  io_uring_cqe* cqe;
  io_uring_for_each_cqe(&ring_, head, cqe) {
    ++seen;
    if (cqe->user_data == kWakeupTag) {
      mailbox_->drain_wakeups();
      wakeup_armed_ = false;
      continue;
    }
    if (cqe->user_data == kCancelTag) continue;
    if (cqe->user_data & kLinkedPollBit) {  // a read_ready's poll: its read's CQE follows
      reinterpret_cast<IoRequest*>(cqe->user_data & ~kLinkedPollBit)->result = cqe->res;
      continue;
    }
    complete(static_cast<IoRequest*>(io_uring_cqe_get_data(cqe)), cqe->res);
  }
  io_uring_cq_advance(&ring_, seen);
  if (!wakeup_armed_) arm_wakeup_poll();
  // Resumed coroutines may enqueue more; they land in the SQ for the next round.
  resuming_.swap(done_);
  for (resumed_ = 0; resumed_ < resuming_.size();) resuming_[resumed_++]->finish();
  resuming_.clear();
  resumed_ = 0;
}

void UringEngine::complete(IoRequest* req, int res) {
  if (req->op == IoRequest::Op::read_ready && res == -ECANCELED && req->result < 0) {
    res = static_cast<int>(req->result);  // the poll's own error (cancel() gives -ECANCELED too)
  }
  // Transient: queue the same request again (a driver command's EAGAIN is the
  // driver's to interpret; a read_ready's says another reader took the data).
  const bool retry_eagain = req->op != IoRequest::Op::uring_cmd && req->op != IoRequest::Op::read_ready;
  if (res == -EINTR || (res == -EAGAIN && retry_eagain)) {
    if (!try_prepare(req)) backlog_.push_back(req);
    return;
  }
  // A timer that ran out completes with -ETIME: its success.
  req->result = req->op == IoRequest::Op::timeout && res == -ETIME ? 0 : res;
  done_.push_back(req);
}

// Checked first: take() builds a std::deque (two allocations) even when
// nothing was posted, which is most loop iterations of a busy FUSE ring.
void UringEngine::run_posted() {
  if (!mailbox_->has_work()) return;
  for (auto& fn : mailbox_->take()) fn();
}

}  // namespace qcowfs::io
