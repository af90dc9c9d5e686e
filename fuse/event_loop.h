// EventLoop: one FUSE queue thread. It owns an io::Engine and runs
//   while (requests may still arrive or are in flight) engine.run_once(-1);
// A reader coroutine waits (io::IoRequest poll_in) until the shared,
// non-blocking /dev/fuse fd is readable, reads up to kReadBatch requests into
// this thread's buffers and hands each to fuse_session_process_buf(). The
// handlers (fuse/filesystem.cc) spawn one Task per request through
// spawn_request(); the Task replies when its I/O completes, so the thread is
// never blocked on host I/O.
//
// The reader polls an epoll instance holding the /dev/fuse fd and a private
// eventfd, so request_stop() can wake it from any thread. Stopping: the
// reader stops reading, in-flight requests finish and reply, the thread ends.
// A read() of /dev/fuse failing with ENODEV means the filesystem was unmounted
// externally; the loop reports it through Config::on_session_end.
//
// Thread-safety: start(), request_stop() and join() are called by the thread
// that owns the EventLoop object; request_stop() is also safe from any
// thread. Everything in the "loop thread" section must be called on the
// loop's own thread (from a handler or a request Task).
#pragma once

#include <atomic>
#include <cstddef>
#include <functional>
#include <future>
#include <memory>
#include <span>
#include <thread>

#include "fuse/buffer_pool.h"
#include "io/fd.h"
#include "io/engine.h"
#include "io/status.h"
#include "io/task.h"

struct fuse_session;

namespace qcowfs::fuse {

class PooledBuffer;

constexpr int kReadBatch = 16;  // requests read per wake-up before yielding to completions

class EventLoop {
 public:
  struct Config {
    fuse_session* session = nullptr;
    int fuse_fd = -1;  // shared by all loops, O_NONBLOCK
    io::EngineKind engine_kind = io::EngineKind::automatic;
    size_t mem_align = io::kMinMemAlign;  // alignment of read result buffers
    // Called on the loop thread when the session ends under us: ok when the
    // filesystem was unmounted (ENODEV), an error when /dev/fuse failed.
    std::function<void(Status)> on_session_end;
  };

  explicit EventLoop(Config cfg);
  ~EventLoop();
  EventLoop(const EventLoop&) = delete;
  EventLoop& operator=(const EventLoop&) = delete;

  // Starts the thread; returns once its engine exists, or why it could not.
  Status start();
  void request_stop();
  // Waits for the thread: it ends once stopped and its requests have replied.
  void join();

  // ---- loop thread ----
  static EventLoop* current();
  // Runs t as a request: the loop does not exit before t finishes.
  void spawn_request(Task<void> t);
  // Keeps the payload of the WRITE being dispatched valid until its host
  // write completes. Large payloads keep the request buffer they were read
  // into (zero copy; the reader continues with a fresh one); payloads up to
  // kCopyWriteMax are copied into a pooled buffer and `payload` is pointed there.
  PooledBuffer hold_write_payload(std::span<const std::byte>& payload);
  io::AlignedBuffer take_read_buffer(size_t size);
  // Gives a buffer back for reuse.
  void recycle(io::AlignedBuffer buf);

 private:
  void thread_main(std::promise<Status>* started);
  Status make_wake_fds();
  Task<void> reader();
  // Reads and dispatches up to kReadBatch requests; false when the session ended.
  bool drain();
  bool stop_requested() const { return stop_.load(std::memory_order_acquire); }

  Config cfg_;
  io::UniqueFd epoll_;
  io::UniqueFd wake_;
  std::atomic<bool> stop_{false};
  std::thread thread_;

  // Loop-thread state.
  size_t inflight_ = 0;
  io::AlignedBuffer current_;  // the buffer the next request is read into
  BufferPool request_pool_;
  SizedBufferPool read_pool_;
};

// Returns a loop buffer to its loop's pools when dropped (on the loop thread).
class PooledBuffer {
 public:
  PooledBuffer(EventLoop* loop, io::AlignedBuffer buf) : loop_(loop), buf_(std::move(buf)) {}
  PooledBuffer(PooledBuffer&&) = default;
  PooledBuffer& operator=(PooledBuffer&&) = delete;
  PooledBuffer(const PooledBuffer&) = delete;
  PooledBuffer& operator=(const PooledBuffer&) = delete;
  ~PooledBuffer() {
    if (loop_ && buf_.data()) loop_->recycle(std::move(buf_));
  }
  std::byte* data() { return buf_.data(); }

 private:
  EventLoop* loop_;
  io::AlignedBuffer buf_;
};

}  // namespace qcowfs::fuse
