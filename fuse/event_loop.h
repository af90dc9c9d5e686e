// EventLoop: one FUSE queue thread. It owns an io::Engine and runs
//   while (requests may still arrive or are in flight) engine.run_once(-1);
// On io_uring, kReadChains reader coroutines each keep one read of the shared,
// non-blocking /dev/fuse fd waiting in the loop's ring (io::IoRequest
// read_ready: the kernel reads a request into the chain's buffer when one
// arrives) and hand what they read to process(): READ and WRITE to
// Config::serve_direct, the rest to fuse_session_process_buf(). On other
// engines one reader waits (poll_in) until the fd is readable and read()s up
// to kReadBatch requests into this thread's buffers. The
// handlers (fuse/filesystem.cc) spawn one Task per request through
// spawn_request(); the Task replies when its I/O completes, so the thread is
// never blocked on host I/O.
//
// The loops of one session share a ReaderGroup: the first loop's reader always
// polls /dev/fuse; the others' readers ("helpers") only while the first loop
// has two or more requests and kHelperBytes or more of READ and WRITE data in
// flight (large requests, whose copies one CPU cannot keep up with; 4 KiB
// requests at QD32 ran 1.2-1.5x faster on one loop): a helper's chain sleeps
// before it waits, and the single reader after a wake-up that found nothing to
// read, if the first loop is below that and the helper has no request of its
// own in flight. So at queue depth 1 one thread serves every request (two
// polling loops woke each other in turn: 20-25 us of a 4 KiB request's 95),
// and with large requests in flight every loop reads. The first loop's
// request that raises its level to two wakes the sleeping helpers (post()); a
// missed wake-up costs only parallelism, never a request, since the first
// loop always reads.
// The reader (chain 0 likewise; the other chains always exclusively) polls
// /dev/fuse itself; an idle loop as an exclusive waiter
// (io_uring's EPOLLEXCLUSIVE poll): FUSE wakes one exclusive waiter per queued
// request, so a request wakes one idle loop, not all of them; a loop with
// requests in flight as a plain waiter, so a request arriving while it is busy
// also wakes an idle loop. request_stop() posts to the loop a cancel of that
// poll. Stopping: the reader stops reading, in-flight
// requests finish and reply, the thread ends.
// A read() of /dev/fuse failing with ENODEV means the filesystem was unmounted
// externally; the loop reports it through Config::on_session_end.
//
// FUSE over io_uring: once the session is initialized, start_ring() gives the
// loop a FuseRing serving the kernel queues in Config::ring_qids. Requests
// then arrive as completions on the loop's own ring and replies leave through
// it (see fuse/fuse_ring.h); /dev/fuse stays polled for what the kernel still
// sends there. Every reply (libfuse's, and send_reply()'s) passes through
// EventLoop::write_reply();
// short replies to /dev/fuse requests leave through the loop's io_uring too
// (fuse/reply_queue.h), and the loop does not end before they have.
//
// Thread-safety: start(), request_stop() and join() are called by the thread
// that owns the EventLoop object; request_stop() is also safe from any
// thread. Everything in the "loop thread" section must be called on the
// loop's own thread (from a handler or a request Task). ReaderGroup is shared
// by the loops: its level is atomic, its request buffer pool behind a mutex.
#pragma once

#include <atomic>
#include <coroutine>
#include <cstddef>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <span>
#include <optional>
#include <thread>
#include <vector>

#include "fuse/buffer_pool.h"
#include "fuse/reply_queue.h"
#include "io/fd.h"
#include "io/engine.h"
#include "io/status.h"
#include "io/task.h"

struct fuse_session;
struct fuse_req;
struct fuse_buf;
struct iovec;

namespace qcowfs::fuse {

class FuseRing;
class EventLoop;

// The /dev/fuse readers of one session's loops (see EventLoop). Thread-safe;
// it must outlive the loops' threads (Server joins every loop before
// destroying any).
class ReaderGroup {
 public:
  explicit ReaderGroup(size_t loops);
  // Loop `index` (0: the one that always reads) serves the session; null: it ended.
  void set_loop(size_t index, EventLoop* loop);
  // Loop 0 publishes its requests in flight and their data bytes; from two
  // requests and kHelperBytes on, the sleeping helpers are woken. Only the
  // level (0, 1, two or more) is stored, and only when it changes: at a
  // steady queue depth this costs no atomic write (a seq_cst store was ~1.6%
  // of the daemon's samples at QD32).
  void set_first_inflight(size_t n, uint64_t bytes);
  // Whether a helper with `own` requests in flight may sleep.
  bool quiet(size_t own) const { return first_level_.load() + own <= 1; }

  // The loops' request buffers, shared (any thread): a buffer a WRITE kept
  // goes back here when the WRITE is done, for whichever loop reads next, so
  // the loops together hold what their requests need, not each its own peak.
  io::AlignedBuffer take_request_buffer();
  void give_request_buffer(io::AlignedBuffer buf);

 private:
  // Written by loop 0 only, read by helpers when they may sleep: one line of
  // its own, so loop 0's writes do not bounce the loops' other shared data.
  alignas(64) std::atomic<size_t> first_level_{0};
  size_t published_ = 0;  // loop 0's last stored level; loop 0 only
  alignas(64) std::unique_ptr<std::atomic<EventLoop*>[]> loops_;
  size_t count_;
  std::mutex pool_mu_;
  BufferPool request_pool_;  // guarded by pool_mu_
};

// Helpers read /dev/fuse while loop 0 has this much READ and WRITE data in
// flight (and two or more requests; see EventLoop).
constexpr uint64_t kHelperBytes = uint64_t{1} << 20;

// /dev/fuse reads a loop keeps waiting in its io_uring (Op::read_ready): a
// request arriving completes one of them, read by the kernel, with no read()
// of ours. 8 against 4: the floor daemon's 4 KiB QD32 reads 1.34-1.59x its
// poll-then-read() figure, 4 chains 1.02-1.42x (bench/RESULTS.md, "Reading
// /dev/fuse in the loop's ring").
constexpr size_t kReadChains = 8;
// Every chain waiting holds a request buffer (max_write and headers, so a
// 2 MiB huge page), and the kernel wakes the longest-waiting chain first, so
// each waiting chain's buffer is faulted in and zeroed by the requests that
// rotate through them. With large WRITEs in flight, which keep their request
// buffers, that is a buffer per chain besides one per WRITE. So a loop's
// chains past the first kLargeIoChains wait only while its waiting chains and
// the request buffers its WRITEs keep number fewer than kReadChains (they
// sleep until a WRITE gives one back), and a helper loop, which reads only
// while large requests are in flight, has only kLargeIoChains chains; the
// loops share their request buffers (ReaderGroup). A one-pass 1 GiB fill
// faulted in 29-32 huge pages against 14-17 with the previous read() loop, at
// ~3.5 ms each on this VM (~7% of a fill); now 18.
constexpr size_t kLargeIoChains = 2;
// Engines without read_ready: requests read per wake-up before the loop
// submits their host I/O and reaps completions. Small, so the first request
// of a burst reaches the disk and finished requests are replied without
// waiting for 16 reads: 4 KiB random reads at QD32 went from 0.655x to 0.715x
// the raw host file (median of 10 alternating rounds) against 16.
constexpr int kReadBatch = 4;

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
    // Called on the loop thread once the kernel has the reply to FUSE_INIT.
    std::function<void()> on_init;
    // FUSE over io_uring: the kernel queues (CPU numbers) this loop serves once
    // start_ring() is called, with ring_depth entries each. Empty: none.
    std::vector<uint16_t> ring_qids;
    // With ring_qids set, the INIT reply claims FUSE over io_uring when the
    // kernel offers it, so the connection keeps it even if fuse.enable_uring
    // is switched off later (every loop serves at least one queue, so all or none do).
    unsigned ring_depth = 0;
    // The INIT reply claims FUSE passthrough (fuse/passthrough.h) when the
    // kernel offers it; on_init then registers the backing file.
    bool passthrough = false;
    // Called on the loop thread when the ring could not be set up (the loop
    // keeps serving through /dev/fuse).
    std::function<void(Status)> on_ring_failure;
    // Called once on the loop thread when start_ring()'s outcome is known: at
    // once when the loop has no ring, else after the ring's registrations went
    // to the kernel and an immediate refusal (fuse.enable_uring off, no kernel
    // support) was reported through on_ring_failure.
    std::function<void()> on_ring_settled;
    // The session's readers, shared by its loops, and this loop's index in it
    // (0 always reads /dev/fuse). Null: this loop always reads.
    std::shared_ptr<ReaderGroup> readers;
    size_t reader_index = 0;
    // Serves a request message without libfuse (Filesystem::serve_direct):
    // true when it did. Tried first for every request after FUSE_INIT.
    std::function<bool(std::span<std::byte> message)> serve_direct;
  };

  explicit EventLoop(Config cfg);
  ~EventLoop();
  EventLoop(const EventLoop&) = delete;
  EventLoop& operator=(const EventLoop&) = delete;

  // Starts the thread; returns once its engine exists, or why it could not.
  Status start();
  // Sets up FUSE over io_uring on the loop thread (thread-safe; after INIT).
  void start_ring();
  void request_stop();
  // Waits for the thread: it ends once stopped and its requests have replied.
  void join();

  // ---- loop thread ----
  static EventLoop* current();
  // Runs t as a request: the loop does not exit before t finishes. `bytes`:
  // the data it reads or writes (ReaderGroup::set_first_inflight()).
  void spawn_request(Task<void> t, uint64_t bytes = 0);
  // Keeps the payload of the WRITE being dispatched valid until its host
  // write completes. Large payloads keep the request buffer they were read
  // into (zero copy; the reader continues with a fresh one); payloads up to
  // kCopyWriteMax are copied into a pooled buffer and `payload` is pointed there.
  // Requests that came through the FUSE ring need no copy: their payload stays
  // in the ring entry until the request replies.
  PooledBuffer hold_write_payload(std::span<const std::byte>& payload);
  // A buffer for the data of a READ reply of `size` bytes, aligned for
  // O_DIRECT: for a ring request its entry's payload buffer (no copy on reply).
  PooledBuffer read_buffer(size_t size);
  // Gives a buffer back for reuse (a request buffer a WRITE kept: return_kept()).
  void recycle(io::AlignedBuffer buf);
  // Whether chain `index` of a loop sleeps rather than wait for a request while
  // `kept` request buffers are held by WRITEs and `armed` chains wait (see kLargeIoChains).
  static bool chain_rests(size_t index, size_t kept, size_t armed) {
    return index >= kLargeIoChains && kept + armed >= kReadChains;
  }
  // The libfuse reply path (fuse_custom_io::writev): replies to ring requests
  // go to their ring entry, all others are written to /dev/fuse `fd`.
  static ssize_t write_reply(int fd, iovec* iov, int count, void* userdata);
  // Answers a READ with the first len (> 0) bytes of buf (fuse_reply_buf).
  // If the reply is queued to /dev/fuse, the queue takes buf (leaving it
  // empty) rather than copying its bytes (ReplyQueue::queue()).
  static void reply_read(fuse_req* req, PooledBuffer& buf, size_t len);
  // Replies to request `unique` of this loop's session without libfuse: the
  // header (error: 0 or a negative errno) and then `args`, through
  // write_reply(). When args is exactly the first bytes of *lent, a queued
  // /dev/fuse reply takes *lent instead of copying them, as reply_read() does.
  static void send_reply(uint64_t unique, int error, std::span<const iovec> args, PooledBuffer* lent = nullptr);

 private:
  void thread_main(std::promise<Status>* started);
  void serve(io::Engine& engine);
  void start_ring_here();
  void ring_settled();
  void dispatch(std::span<std::byte> message);
  // Hands a request to Config::serve_direct, else to libfuse.
  void process(std::span<std::byte> message);
  void note_init(const fuse_buf& buf);
  ssize_t write_init_reply(int fd, iovec* iov, int count);
  void cancel_reader_wait();
  // A request buffer from the group's shared pool (this loop's without a group), and back.
  io::AlignedBuffer take_request_buffer();
  void give_request_buffer(io::AlignedBuffer buf);
  // Gives back a request buffer a WRITE kept (hold_write_payload()); wakes the
  // chains resting for one.
  void return_kept(io::AlignedBuffer buf);
  Task<void> reader();
  // One of kReadChains readers of an engine that reads /dev/fuse in the kernel
  // when a request arrives (io::IoRequest::Op::read_ready).
  Task<void> chain_reader(size_t index);
  bool chain_exclusive(size_t index) const;
  // Hands the request read into current_ (n bytes) to process(), FUSE_INIT
  // to libfuse; a large WRITE may keep the buffer (hold_write_payload()), leaving current_ empty.
  void process_current(size_t n);
  void end_session(Status st);
  // A helper's reader: suspends while the group is quiet (true: it slept).
  struct SleepAwaiter;
  bool may_sleep();
  friend class ReaderGroup;
  // From any thread: resumes this helper's reader if it sleeps.
  void wake_reader();
  // Reads and dispatches up to kReadBatch requests (one when this loop has
  // no other request in flight): how many, none when the session ended.
  std::optional<int> drain();
  bool read_more_now() const;
  bool stop_requested() const { return stop_.load(std::memory_order_acquire); }

  Config cfg_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  std::mutex engine_mu_;
  io::Engine* engine_ = nullptr;  // the loop thread's engine while it runs (for start_ring())

  // Loop-thread state.
  size_t inflight_ = 0;
  uint64_t inflight_bytes_ = 0;
  size_t kept_request_buffers_ = 0;  // held by WRITEs in flight (hold_write_payload() to recycle())
  size_t armed_chains_ = 0;          // chains waiting for a request
  bool chains_wake_posted_ = false;   // a post() resumes the sleeping chains
  std::vector<io::IoRequest*> reader_waits_;  // the readers' pending /dev/fuse polls (or reads)
  std::vector<std::coroutine_handle<>> sleeping_readers_;  // a helper's readers, resting chains
  bool exclusive_polls_ = true;  // false once the kernel refused an exclusive poll
  bool session_ended_ = false;   // on_session_end was called
  std::atomic<bool> helper_reading_{true};   // a helper's reader polls (or is about to)
  io::AlignedBuffer current_;  // the buffer the next request is read into
  BufferPool request_pool_;  // without a ReaderGroup (tests): this loop's own
  SizedBufferPool read_pool_;
  ReplyQueue replies_;
  PooledBuffer* lent_reply_ = nullptr;  // during reply_read(): the READ's data
  std::unique_ptr<FuseRing> ring_;  // outlives the engine: see thread_main()
  bool ring_settled_ = false;       // on_ring_settled was called
  uint64_t init_unique_ = 0;        // the FUSE_INIT being answered, else 0
  bool init_claims_ring_ = false;   // its reply claims FUSE_OVER_IO_URING
  bool init_claims_passthrough_ = false;  // ... and FUSE_PASSTHROUGH
  bool init_claims_mmap_ = false;         // ... and FUSE_DIRECT_IO_ALLOW_MMAP
};

}  // namespace qcowfs::fuse
