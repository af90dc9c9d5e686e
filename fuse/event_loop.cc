#include "fuse/event_loop.h"

#include <fuse_lowlevel.h>
#include <linux/fuse.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <optional>
#include <utility>

#include "fuse/fuse_ring.h"
#include "fuse/passthrough.h"
#include "fuse/request_buffer.h"
#include "io/align.h"
#include "io/log.h"

namespace qcowfs::fuse {

static_assert(sizeof(fuse_in_header) + sizeof(fuse_write_in) == kWriteHeaderBytes);
static_assert(kRequestBufferSize - kReadOffset >= kMaxWrite + kWriteHeaderBytes);
static_assert(kRequestBufferSize - kReadOffset >= FUSE_MIN_READ_BUFFER);

namespace {
thread_local EventLoop* t_current = nullptr;
constexpr size_t kIdleRequestBuffers = 16;
}  // namespace

ReaderGroup::ReaderGroup(size_t loops)
    : loops_(std::make_unique<std::atomic<EventLoop*>[]>(loops)),
      count_(loops),
      request_pool_(kRequestBufferSize, kPayloadAlign, kIdleRequestBuffers * std::max<size_t>(loops, 1)) {}

io::AlignedBuffer ReaderGroup::take_request_buffer() {
  {
    std::lock_guard lk(pool_mu_);
    if (request_pool_.idle_count() > 0) return request_pool_.take();
  }
  return io::AlignedBuffer::for_large_io(kRequestBufferSize, kPayloadAlign);  // not under the lock
}

void ReaderGroup::give_request_buffer(io::AlignedBuffer buf) {
  std::lock_guard lk(pool_mu_);
  request_pool_.give(std::move(buf));
}

void ReaderGroup::set_loop(size_t index, EventLoop* loop) {
  if (index < count_) loops_[index].store(loop);
}

// The level first, then each helper's flag; a helper going to sleep clears
// its flag before it reads the level (EventLoop::may_sleep()). Both sides are
// seq_cst, so one of the two sees the other: the helper stays awake, or loop 0
// finds its flag cleared and wakes it. A helper never sleeps while the level
// is two (quiet() is false), so a wake-up is needed only when the level rises
// to two.
void ReaderGroup::set_first_inflight(size_t n, uint64_t bytes) {
  const size_t level = n >= 2 && bytes >= kHelperBytes ? 2 : std::min<size_t>(n, 1);
  if (level == published_) return;
  published_ = level;
  first_level_.store(level);
  if (level < 2) return;
  for (size_t i = 1; i < count_; ++i) {
    EventLoop* loop = loops_[i].load(std::memory_order_acquire);
    if (loop && !loop->helper_reading_.load() && !loop->helper_reading_.exchange(true)) loop->wake_reader();
  }
}

EventLoop::EventLoop(Config cfg)
    : cfg_(std::move(cfg)),
      request_pool_(kRequestBufferSize, kPayloadAlign, kIdleRequestBuffers),
      read_pool_(cfg_.mem_align) {}

EventLoop::~EventLoop() {
  request_stop();
  join();
}

EventLoop* EventLoop::current() { return t_current; }

void EventLoop::start_ring() {
  std::lock_guard lk(engine_mu_);
  if (engine_) engine_->post([this] { start_ring_here(); });
}

Status EventLoop::start() {
  std::promise<Status> started;
  auto result = started.get_future();
  thread_ = std::thread([this, &started] { thread_main(&started); });
  Status st = result.get();
  if (!st) join();
  return st;
}

// The flag first: a reader that has not armed its poll yet sees it (the
// mutex orders it before the loop's engine_ assignment); one that has is woken
// by the cancel, which runs on the loop thread.
void EventLoop::request_stop() {
  stop_.store(true, std::memory_order_release);
  std::lock_guard lk(engine_mu_);
  if (engine_) engine_->post([this] { cancel_reader_wait(); });
}

namespace {
void resume_all(std::vector<std::coroutine_handle<>>& sleepers) {
  std::vector<std::coroutine_handle<>> woken;
  woken.swap(sleepers);
  for (std::coroutine_handle<> h : woken) h.resume();
}
}  // namespace

void EventLoop::cancel_reader_wait() {
  for (io::IoRequest* wait : reader_waits_)
    if (wait) io::Engine::current()->cancel(wait);
  resume_all(sleeping_readers_);
}

void EventLoop::wake_reader() {
  std::lock_guard lk(engine_mu_);
  if (engine_) engine_->post([this] { resume_all(sleeping_readers_); });
}

struct EventLoop::SleepAwaiter {
  EventLoop& loop;
  bool await_ready() const noexcept { return false; }
  void await_suspend(std::coroutine_handle<> h) { loop.sleeping_readers_.push_back(h); }
  void await_resume() const noexcept {}
};

// A helper sleeps after a wake-up that found nothing to read (another loop
// took the request) while the group is quiet: its flag cleared first, then
// the level read again (ReaderGroup::set_first_inflight() has the other order).
bool EventLoop::may_sleep() {
  if (!cfg_.readers || cfg_.reader_index == 0 || !cfg_.readers->quiet(inflight_)) return false;
  helper_reading_.store(false);
  if (cfg_.readers->quiet(inflight_)) return true;
  helper_reading_.store(true);
  return false;
}

void EventLoop::join() {
  if (thread_.joinable()) thread_.join();
}

void EventLoop::thread_main(std::promise<Status>* started) {
  io::EngineFeatures features;
  features.uring_cmd = !cfg_.ring_qids.empty();
  auto engine = io::make_engine(cfg_.engine_kind, 256, features);
  if (!engine) {
    started->set_value(engine.status().with_context("starting a queue thread"));
    return;
  }
  {
    std::lock_guard lk(engine_mu_);
    engine_ = engine->get();
  }
  if (cfg_.readers) cfg_.readers->set_loop(cfg_.reader_index, this);
  {
    io::ScopedEngine scope(engine->get());
    t_current = this;
    started->set_value(Status::ok());  // `started` is gone after this line
    serve(**engine);
    t_current = nullptr;
  }
  if (cfg_.readers) cfg_.readers->set_loop(cfg_.reader_index, nullptr);
  {
    std::lock_guard lk(engine_mu_);
    engine_ = nullptr;
  }
  // Closing the ring first: until then the kernel may copy requests into ring entries.
  engine->reset();
  if (ring_) log::debug("queue thread served {} requests through io_uring", ring_->requests_served());
  ring_.reset();
}

void EventLoop::serve(io::Engine& engine) {
  const bool helper = cfg_.readers && cfg_.reader_index > 0;
  const size_t readers = !engine.submits_inline() ? 1 : helper ? kLargeIoChains : kReadChains;
  reader_waits_.assign(readers, nullptr);
  size_t readers_left = readers;
  for (size_t i = 0; i < readers; ++i) {
    spawn_then(readers == 1 ? reader() : chain_reader(i), [&readers_left] { --readers_left; });
  }
  while (readers_left > 0 || inflight_ > 0 || replies_.pending() > 0) engine.run_once(-1);
  if (ring_) ring_->stop();
  engine.run_once(0);  // submits the ring commits of the last replies
}

void EventLoop::start_ring_here() {
  if (ring_ || cfg_.ring_qids.empty() || stop_requested()) {
    ring_settled();
    return;
  }
  FuseRing::Config rc;
  rc.fuse_fd = cfg_.fuse_fd;
  rc.qids = cfg_.ring_qids;
  rc.entries_per_queue = cfg_.ring_depth;
  rc.payload_bytes = kMaxWrite + kPayloadAlign;  // >= max_write and max_pages * page size
  rc.dispatch = [this](std::span<std::byte> message) { dispatch(message); };
  rc.on_failure = [this](Status st) {
    if (cfg_.on_ring_failure) cfg_.on_ring_failure(std::move(st));
  };
  ring_ = std::make_unique<FuseRing>(std::move(rc));
  if (Status st = ring_->start(); !st) {
    if (cfg_.on_ring_failure) cfg_.on_ring_failure(std::move(st));
    ring_settled();
    return;
  }
  // The registrations reach the kernel in the engine's next io_uring_enter,
  // which also reaps a refusal (the kernel refuses them synchronously); work
  // posted now runs after that reap.
  io::Engine::current()->post([this] { ring_settled(); });
}

void EventLoop::ring_settled() {
  if (ring_settled_) return;
  ring_settled_ = true;
  if (cfg_.on_ring_settled) cfg_.on_ring_settled();
}

void EventLoop::dispatch(std::span<std::byte> message) {
  if (stop_requested()) {  // left to the kernel, as unread /dev/fuse requests are
    ring_->stop();
    return;
  }
  process(message);
}

// Every request after FUSE_INIT; INIT itself is libfuse's, and the kernel
// sends nothing else before its reply.
void EventLoop::process(std::span<std::byte> message) {
  if (cfg_.serve_direct && cfg_.serve_direct(message)) return;
  fuse_buf buf = {};
  buf.mem = message.data();
  buf.size = message.size();
  fuse_session_process_buf(cfg_.session, &buf);
}

ssize_t EventLoop::write_reply(int fd, iovec* iov, int count, void*) {
  EventLoop* loop = t_current;
  if (loop && loop->ring_) {
    if (auto taken = loop->ring_->reply(iov, count)) return *taken;
  }
  if (loop && loop->init_unique_ != 0) return loop->write_init_reply(fd, iov, count);
  if (loop && io::Engine::current()) {
    if (auto queued = loop->replies_.queue(*io::Engine::current(), fd, iov, count, loop->lent_reply_))
      return *queued;
  }
  return ::writev(fd, iov, count);
}

void EventLoop::send_reply(uint64_t unique, int error, std::span<const iovec> args, PooledBuffer* lent) {
  EventLoop* loop = t_current;
  if (!loop || args.size() > 2) return;  // only on a loop thread, as every request task runs
  fuse_out_header out = {};
  out.len = sizeof out;
  for (const iovec& a : args) out.len += static_cast<uint32_t>(a.iov_len);
  out.error = error;
  out.unique = unique;
  iovec iov[3] = {{&out, sizeof out}};
  std::copy(args.begin(), args.end(), iov + 1);
  loop->lent_reply_ = lent;
  // As libfuse's replies: a failed write means the kernel no longer waits for
  // this one (interrupted, or the connection ended); nothing to tell anyone.
  ssize_t n = write_reply(loop->cfg_.fuse_fd, iov, static_cast<int>(args.size()) + 1, nullptr);
  loop->lent_reply_ = nullptr;
  if (n < 0) log::debug("{}", Status::from_errno(errno, "replying to a FUSE request").to_string());
}

void EventLoop::reply_read(fuse_req* req, PooledBuffer& buf, size_t len) {
  EventLoop* loop = t_current;
  if (loop) loop->lent_reply_ = &buf;
  fuse_reply_buf(req, reinterpret_cast<const char*>(buf.data()), len);
  if (loop) loop->lent_reply_ = nullptr;
}

// The kernel offers FUSE_OVER_IO_URING (flags2 bit 9, protocol 7.42) in
// FUSE_INIT when fuse.enable_uring is on; libfuse 3.14 does not know the flag.
constexpr uint32_t kOverIoUringFlag2 = 1u << 9;
// FUSE_DIRECT_IO_ALLOW_MMAP (flags2 bit 4, Linux 6.6+, protocol 7.39): shared
// mappings of direct_io opens, served from the page cache for the mapped
// pages only. The kernel keeps them coherent with our direct reads and writes
// (a direct read writes dirty mapped pages back first, a direct write drops the
// cached pages it covers). Always claimed when offered; libfuse 3.14 does not
// know it. Without it (older kernels) shared mmap of the view fails with ENODEV.
constexpr uint32_t kDirectIoAllowMmapFlag2 = 1u << 4;

void EventLoop::note_init(const fuse_buf& buf) {
  const auto* in = static_cast<const fuse_in_header*>(buf.mem);
  init_unique_ = in->unique;
  init_claims_ring_ = false;
  init_claims_passthrough_ = false;
  init_claims_mmap_ = false;
  fuse_init_in arg = {};
  if (buf.size < sizeof *in + offsetof(fuse_init_in, flags2) + sizeof arg.flags2) return;
  std::memcpy(&arg, static_cast<const std::byte*>(buf.mem) + sizeof *in,
              std::min(sizeof arg, buf.size - sizeof *in));
  const bool offered = (arg.flags & FUSE_INIT_EXT) && (arg.flags2 & kOverIoUringFlag2);
  init_claims_ring_ = offered && !cfg_.ring_qids.empty() && engine_ && engine_->supports_uring_cmd();
  init_claims_passthrough_ = cfg_.passthrough && (arg.flags & FUSE_INIT_EXT) && (arg.flags2 & passthrough::kInitFlag2);
  init_claims_mmap_ = (arg.flags & FUSE_INIT_EXT) && (arg.flags2 & kDirectIoAllowMmapFlag2);
  if (!init_claims_mmap_) log::info("this kernel cannot map the view shared (needs Linux 6.6+): MAP_SHARED fails with ENODEV");
}

// Where fuse_init_out (7.40) keeps max_stack_depth: the word after flags2,
// unused[0] in libfuse 3.14's copy of the struct.
constexpr size_t kMaxStackDepthOffset = offsetof(fuse_init_out, flags2) + sizeof(uint32_t);

// Once the INIT reply claims io_uring, the kernel holds new requests until every
// queue has a ring entry (or a registration fails), so the claim is made only
// when this process will register (see Config::ring_qids).
ssize_t EventLoop::write_init_reply(int fd, iovec* iov, int count) {
  fuse_out_header out;
  std::memcpy(&out, iov[0].iov_base, sizeof out);
  const bool patch = init_claims_ring_ || init_claims_passthrough_ || init_claims_mmap_;
  if (!patch || out.unique != init_unique_ || out.error != 0 || count != 2 || iov[0].iov_len != sizeof out ||
      iov[1].iov_len < kMaxStackDepthOffset + sizeof(uint32_t) || iov[1].iov_len > sizeof(fuse_init_out))
    return ::writev(fd, iov, count);
  fuse_init_out arg = {};
  std::memcpy(&arg, iov[1].iov_base, iov[1].iov_len);
  arg.flags |= FUSE_INIT_EXT;
  if (init_claims_ring_) arg.flags2 |= kOverIoUringFlag2;
  if (init_claims_mmap_) arg.flags2 |= kDirectIoAllowMmapFlag2;
  if (init_claims_passthrough_) {
    arg.flags2 |= passthrough::kInitFlag2;
    const uint32_t depth = passthrough::kMaxStackDepth;
    std::memcpy(reinterpret_cast<std::byte*>(&arg) + kMaxStackDepthOffset, &depth, sizeof depth);
  }
  iovec patched[2] = {iov[0], {&arg, iov[1].iov_len}};
  return ::writev(fd, patched, 2);
}

// An idle loop's poll is exclusive (see the header): FUSE's wake_up() wakes
// one exclusive waiter per request, so at queue depth 1 one loop wakes. A loop
// with requests in flight polls as a plain waiter: wake_up() wakes every plain
// waiter and then the exclusive one that armed first, which, busy or not, was
// the only one woken while every poll was exclusive, so requests queued behind
// a busy loop while the other slept (1 MiB reads at QD8: 15-25% slower). No
// request is left unread: a loop re-arms its poll after every drain, and a
// poll armed on a readable /dev/fuse completes at once. A kernel that refuses
// exclusive polls (EINVAL) gets plain ones, which wake every loop.
Task<void> EventLoop::reader() {
  bool exclusive = true;
  bool idle_wakeup = false;  // the last wake-up found nothing to read
  while (!stop_requested()) {
    if (idle_wakeup && may_sleep()) {
      co_await SleepAwaiter{*this};  // until ReaderGroup::set_first_inflight() or request_stop()
      continue;
    }
    io::IoRequest poll;
    poll.op = io::IoRequest::Op::poll_in;
    poll.fd = cfg_.fuse_fd;
    poll.poll_exclusive = exclusive && inflight_ == 0;  // idle: exclusive
    io::IoAwaiter waiting = io::async(std::move(poll));
    reader_waits_[0] = &waiting.req;
    int64_t r = co_await waiting;
    reader_waits_[0] = nullptr;
    if (r == -ECANCELED) continue;  // request_stop()
    if (r == -EINVAL && exclusive) {
      exclusive = false;
      continue;
    }
    if (r < 0 && r != -EINTR) {
      end_session(Status::from_errno(static_cast<int>(-r), "waiting for /dev/fuse"));
      co_return;
    }
    const std::optional<int> read = stop_requested() ? std::nullopt : drain();
    if (!read) co_return;
    idle_wakeup = *read == 0;
  }
}

// Chain 0 follows the rule above (exclusive while the loop is idle, plain
// while it is busy, so a request arriving then also wakes an idle loop); the
// others always wait exclusively, so one request wakes one of them, not all.
bool EventLoop::chain_exclusive(size_t index) const { return exclusive_polls_ && (index > 0 || inflight_ == 0); }

// Each chain waits with a read_ready on /dev/fuse: the kernel reads the request
// into the chain's buffer when it arrives, in the loop's next io_uring_enter.
// -EAGAIN: another reader took it. A request read after request_stop() is
// still handed to libfuse (the kernel waits for its reply); no new read is
// queued after it.
Task<void> EventLoop::chain_reader(size_t index) {
  io::AlignedBuffer buf;
  while (!stop_requested()) {
    // A helper's chain does not wait while the group is quiet, even after a
    // request: exclusive waiters are woken in the order they were armed, so
    // a helper's long-armed chains would take every other request from loop 0.
    // Nor do the chains past kLargeIoChains while large WRITEs keep buffers.
    if (may_sleep() || chain_rests(index, kept_request_buffers_, armed_chains_)) {
      if (buf.data()) give_request_buffer(std::move(buf));  // another chain may use it meanwhile
      co_await SleepAwaiter{*this};
      continue;
    }
    if (!buf.data()) buf = take_request_buffer();
    io::IoRequest rq;
    rq.op = io::IoRequest::Op::read_ready;
    rq.fd = cfg_.fuse_fd;
    rq.buf = request_read_start(buf);
    rq.length = request_read_capacity(buf);
    rq.poll_exclusive = chain_exclusive(index);
    io::IoAwaiter waiting = io::async(std::move(rq));
    reader_waits_[index] = &waiting.req;
    ++armed_chains_;
    const int64_t r = co_await waiting;
    --armed_chains_;
    reader_waits_[index] = nullptr;
    if (r == -ECANCELED || r == -EAGAIN || r == -EINTR || r == -ENOENT) continue;  // ENOENT: interrupted meanwhile
    if (r == -EINVAL && exclusive_polls_ && rq.poll_exclusive) {
      exclusive_polls_ = false;  // the kernel refuses exclusive polls: plain ones
      continue;
    }
    if (r == -EINVAL) {  // nor a read linked to a poll: poll, then read()
      if (index == 0) {
        log::info("reading /dev/fuse with read(): this kernel's io_uring cannot read it when ready");
        co_await reader();
      }
      co_return;
    }
    if (r < 0) {
      end_session(r == -ENODEV ? Status::ok() : Status::from_errno(static_cast<int>(-r), "reading /dev/fuse"));
      co_return;
    }
    current_ = std::move(buf);
    process_current(static_cast<size_t>(r));
    buf = std::move(current_);  // empty when a WRITE kept it
  }
}

void EventLoop::end_session(Status st) {
  if (std::exchange(session_ended_, true)) return;
  stop_.store(true, std::memory_order_release);  // this loop's other readers end too
  cancel_reader_wait();
  cfg_.on_session_end(std::move(st));
}

void EventLoop::process_current(size_t n) {
  std::span<std::byte> message(request_read_start(current_), n);
  const bool init = n >= sizeof(fuse_in_header) &&
                    reinterpret_cast<const fuse_in_header*>(message.data())->opcode == FUSE_INIT;
  if (!init) {
    process(message);
    return;
  }
  fuse_buf fb = {};
  fb.mem = message.data();
  fb.size = n;
  note_init(fb);
  fuse_session_process_buf(cfg_.session, &fb);
  init_unique_ = 0;
  if (cfg_.on_init) cfg_.on_init();  // the reply has reached the kernel
}

std::optional<int> EventLoop::drain() {
  int read = 0;
  for (int i = 0; i < kReadBatch && !stop_requested(); ++i) {
    if (!current_.data()) current_ = take_request_buffer();
    ssize_t n = ::read(cfg_.fuse_fd, request_read_start(current_), request_read_capacity(current_));
    if (n < 0) {
      int err = errno;
      if (err == EAGAIN) return read;
      if (err == EINTR || err == ENOENT) continue;  // ENOENT: the request was interrupted meanwhile
      end_session(err == ENODEV ? Status::ok() : Status::from_errno(err, "reading /dev/fuse"));
      return std::nullopt;
    }
    ++read;
    process_current(static_cast<size_t>(n));
    if (!read_more_now()) return read;
  }
  return read;
}

// Whether to read /dev/fuse again before going back to the engine. With no
// other request of this loop in flight the caller is most likely waiting for
// this one (queue depth 1): another read() would almost always fail with
// EAGAIN, and it would delay the request's host I/O, which is submitted by the
// engine's next io_uring_enter. That same enter re-arms the /dev/fuse poll,
// which completes at once if a request did arrive meanwhile, so nothing waits.
// With requests overlapping, reading on batches them into one enter.
bool EventLoop::read_more_now() const { return inflight_ > 1; }

void EventLoop::spawn_request(Task<void> t, uint64_t bytes) {
  ++inflight_;
  inflight_bytes_ += bytes;
  // Loop 0 publishes its count; ring requests do not come from /dev/fuse.
  ReaderGroup* group = cfg_.reader_index == 0 && !ring_ ? cfg_.readers.get() : nullptr;
  if (group) group->set_first_inflight(inflight_, inflight_bytes_);
  spawn_then(std::move(t), [this, group, bytes] {
    --inflight_;
    inflight_bytes_ -= bytes;
    if (group) group->set_first_inflight(inflight_, inflight_bytes_);
  });
}

PooledBuffer EventLoop::hold_write_payload(std::span<const std::byte>& payload) {
  if (ring_ && !ring_->dispatching_payload().empty()) return PooledBuffer();
  if (payload.size() > kCopyWriteMax) {
    if (current_.data()) ++kept_request_buffers_;  // until recycle()
    return PooledBuffer(this, std::move(current_));
  }
  io::AlignedBuffer copy = read_pool_.take(payload.size());
  std::memcpy(copy.data(), payload.data(), payload.size());
  payload = std::span<const std::byte>(copy.data(), payload.size());
  return PooledBuffer(this, std::move(copy));
}

PooledBuffer EventLoop::read_buffer(size_t size) {
  if (ring_) {
    std::span<std::byte> payload = ring_->dispatching_payload();
    if (size <= payload.size() && is_aligned_ptr(payload.data(), cfg_.mem_align)) return PooledBuffer(payload.data());
  }
  return PooledBuffer(this, read_pool_.take(size));
}

PooledBuffer::~PooledBuffer() {
  if (loop_ && buf_.data()) loop_->recycle(std::move(buf_));
}

io::AlignedBuffer EventLoop::take_request_buffer() {
  return cfg_.readers ? cfg_.readers->take_request_buffer() : request_pool_.take();
}

void EventLoop::give_request_buffer(io::AlignedBuffer buf) {
  if (cfg_.readers) {
    cfg_.readers->give_request_buffer(std::move(buf));
  } else {
    request_pool_.give(std::move(buf));
  }
}

// A request buffer comes back only from a WRITE that kept it (hold_write_payload()).
void EventLoop::return_kept(io::AlignedBuffer buf) {
  give_request_buffer(std::move(buf));
  --kept_request_buffers_;
  // Resumed from the engine, not from inside the request finishing here.
  io::Engine* engine = io::Engine::current();
  if (engine && !sleeping_readers_.empty() && !chains_wake_posted_) {
    chains_wake_posted_ = true;
    engine->post([this] {
      chains_wake_posted_ = false;
      resume_all(sleeping_readers_);
    });
  }
}

void EventLoop::recycle(io::AlignedBuffer buf) {
  if (buf.size() == kRequestBufferSize) {
    return_kept(std::move(buf));
  } else {
    read_pool_.give(std::move(buf));
  }
}

}  // namespace qcowfs::fuse
