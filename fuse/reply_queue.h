// ReplyQueue: replies to /dev/fuse requests written by a loop's own io_uring.
//
// A reply of up to kQueuedReplyMax bytes is copied and enqueued as an
// IORING_OP_WRITEV on /dev/fuse, which the kernel performs inline (/dev/fuse
// is always writable), so it leaves with the loop's next io_uring_enter
// instead of a writev() of its own: a syscall costs ~1 us on the machines we
// measure, a 4 KiB request's whole daemon time 15-20 us (bench/RESULTS.md,
// "Replies through the loop's ring"). A READ reply whose data buffer is lent
// (queue()'s `lent`: header, then that buffer's bytes) has only its header
// copied; the queue owns the buffer until the write has completed. Not
// queued: replies over kQueuedReplyMax (written at once: a 1 MiB reply that
// waits for the loop's next io_uring_enter reaches the reader later, for the
// ~1 us of a syscall; 1 MiB reads measured 0.87x and 0.96x when they were
// queued), notifications (unique 0: their callers
// read the kernel's answer), and any reply once the kernel has refused one
// (a queued reply that fails with anything but ENOENT, request interrupted,
// or ENODEV, unmounted, is written again with writev() and queuing stops).
//
// Thread-safety: one per event loop, used only on that loop's thread, with
// that thread's engine; the loop keeps running its engine until pending() is 0.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <cstddef>
#include <memory>
#include <optional>
#include <vector>

#include "fuse/buffer_pool.h"
#include "io/engine.h"

namespace qcowfs::fuse {

// A 4 KiB READ's reply and its 16-byte header.
constexpr size_t kQueuedReplyMax = 4096 + 16;

class ReplyQueue {
 public:
  ReplyQueue();
  ~ReplyQueue();
  ReplyQueue(const ReplyQueue&) = delete;
  ReplyQueue& operator=(const ReplyQueue&) = delete;

  // Copies the reply in iov and enqueues its write to fd on engine: its
  // size, or nullopt when it is not one to queue (see above; also when the
  // engine does not submit inline) and must be written now. When iov is the
  // header and then exactly the bytes of `lent` from its start, those bytes
  // are not copied: `lent` is moved into the queue (and left empty) until the
  // write completes.
  std::optional<ssize_t> queue(io::Engine& engine, int fd, const iovec* iov, int count,
                               PooledBuffer* lent = nullptr);
  // Replies enqueued and not yet completed.
  size_t pending() const { return pending_; }
  // False once the kernel has refused a queued reply.
  bool queuing() const { return queuing_; }

 private:
  struct Reply;
  static void on_done(io::IoRequest* req);
  void failed(Reply& reply);
  std::unique_ptr<Reply> take_reply();
  void enqueue(io::Engine& engine, int fd, std::unique_ptr<Reply> reply);

  std::vector<std::unique_ptr<Reply>> idle_;
  size_t pending_ = 0;
  bool queuing_ = true;
};

}  // namespace qcowfs::fuse
