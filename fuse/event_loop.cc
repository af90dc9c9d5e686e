#include "fuse/event_loop.h"

#include <fuse_lowlevel.h>
#include <linux/fuse.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>

#include <cerrno>
#include <cstring>

#include "fuse/request_buffer.h"
#include "io/log.h"

namespace qcowfs::fuse {

static_assert(sizeof(fuse_in_header) + sizeof(fuse_write_in) == kWriteHeaderBytes);
static_assert(kRequestBufferSize - kReadOffset >= kMaxWrite + kWriteHeaderBytes);
static_assert(kRequestBufferSize - kReadOffset >= FUSE_MIN_READ_BUFFER);

namespace {
thread_local EventLoop* t_current = nullptr;
constexpr size_t kIdleRequestBuffers = 16;
}  // namespace

EventLoop::EventLoop(Config cfg)
    : cfg_(std::move(cfg)),
      request_pool_(kRequestBufferSize, kPayloadAlign, kIdleRequestBuffers),
      read_pool_(cfg_.mem_align) {}

EventLoop::~EventLoop() {
  request_stop();
  join();
}

EventLoop* EventLoop::current() { return t_current; }

Status EventLoop::make_wake_fds() {
  epoll_.reset(::epoll_create1(EPOLL_CLOEXEC));
  if (!epoll_.valid()) return Status::from_errno(errno, "epoll_create1");
  wake_.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_.valid()) return Status::from_errno(errno, "eventfd");
  for (int fd : {cfg_.fuse_fd, wake_.get()}) {
    epoll_event ev = {};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &ev) != 0) return Status::from_errno(errno, "epoll_ctl");
  }
  return Status::ok();
}

Status EventLoop::start() {
  QCOWFS_TRY(make_wake_fds());
  std::promise<Status> started;
  auto result = started.get_future();
  thread_ = std::thread([this, &started] { thread_main(&started); });
  Status st = result.get();
  if (!st) join();
  return st;
}

void EventLoop::request_stop() {
  stop_.store(true, std::memory_order_release);
  if (!wake_.valid()) return;
  uint64_t one = 1;
  ssize_t n = ::write(wake_.get(), &one, sizeof one);
  (void)n;  // EAGAIN only when the counter is already saturated: the loop is awake anyway
}

void EventLoop::join() {
  if (thread_.joinable()) thread_.join();
}

void EventLoop::thread_main(std::promise<Status>* started) {
  auto engine = io::make_engine(cfg_.engine_kind);
  if (!engine) {
    started->set_value(engine.status().with_context("starting a queue thread"));
    return;
  }
  io::ScopedEngine scope(engine->get());
  t_current = this;
  started->set_value(Status::ok());  // `started` is gone after this line
  bool reader_done = false;
  spawn_then(reader(), [&reader_done] { reader_done = true; });
  while (!reader_done || inflight_ > 0) (*engine)->run_once(-1);
  t_current = nullptr;
}

Task<void> EventLoop::reader() {
  while (!stop_requested()) {
    io::IoRequest poll;
    poll.op = io::IoRequest::Op::poll_in;
    poll.fd = epoll_.get();
    int64_t r = co_await io::async(std::move(poll));
    if (r < 0 && r != -EINTR) {
      cfg_.on_session_end(Status::from_errno(static_cast<int>(-r), "waiting for /dev/fuse"));
      co_return;
    }
    if (stop_requested() || !drain()) co_return;
  }
}

bool EventLoop::drain() {
  for (int i = 0; i < kReadBatch && !stop_requested(); ++i) {
    if (!current_.data()) current_ = request_pool_.take();
    ssize_t n = ::read(cfg_.fuse_fd, request_read_start(current_), request_read_capacity(current_));
    if (n < 0) {
      int err = errno;
      if (err == EAGAIN) return true;
      if (err == EINTR || err == ENOENT) continue;  // ENOENT: the request was interrupted meanwhile
      cfg_.on_session_end(err == ENODEV ? Status::ok() : Status::from_errno(err, "reading /dev/fuse"));
      return false;
    }
    fuse_buf buf = {};
    buf.mem = request_read_start(current_);
    buf.size = static_cast<size_t>(n);
    fuse_session_process_buf(cfg_.session, &buf);
  }
  return true;
}

void EventLoop::spawn_request(Task<void> t) {
  ++inflight_;
  spawn_then(std::move(t), [this] { --inflight_; });
}

PooledBuffer EventLoop::hold_write_payload(std::span<const std::byte>& payload) {
  if (payload.size() > kCopyWriteMax) return PooledBuffer(this, std::move(current_));
  io::AlignedBuffer copy = read_pool_.take(payload.size());
  std::memcpy(copy.data(), payload.data(), payload.size());
  payload = std::span<const std::byte>(copy.data(), payload.size());
  return PooledBuffer(this, std::move(copy));
}

io::AlignedBuffer EventLoop::take_read_buffer(size_t size) { return read_pool_.take(size); }

void EventLoop::recycle(io::AlignedBuffer buf) {
  if (buf.size() == kRequestBufferSize) {
    request_pool_.give(std::move(buf));
  } else {
    read_pool_.give(std::move(buf));
  }
}

}  // namespace qcowfs::fuse
