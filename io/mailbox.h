// Mailbox: the cross-thread inbox of one Engine. post() queues a function and,
// when the poster is another thread, makes the mailbox's eventfd readable so the
// engine's blocking wait returns. The engine drains the eventfd and runs the
// queued functions on its own thread.
//
// Engines hold the Mailbox by shared_ptr and hand copies to worker jobs, so a
// job finishing after its engine is gone posts into a closed mailbox (dropped)
// instead of into freed memory.
//
// Thread-safety: post(), has_work() and take() are thread-safe; drain_wakeups()
// and take() are meant for the owning engine thread.
#pragma once

#include <deque>
#include <functional>
#include <mutex>

#include "io/fd.h"
#include "io/status.h"

namespace qcowfs::io {

class Mailbox {
 public:
  // Creates the eventfd (non-blocking, close-on-exec).
  static Result<std::shared_ptr<Mailbox>> create();
  explicit Mailbox(UniqueFd efd) : efd_(std::move(efd)) {}

  // Queues fn. from_owner: the caller is the engine's own thread, which is not
  // waiting, so no eventfd write is needed (the engine checks has_work() before
  // it blocks).
  void post(std::function<void()> fn, bool from_owner);
  bool has_work();
  std::deque<std::function<void()>> take();
  // Reads the eventfd until it is empty.
  void drain_wakeups();
  // Drops queued and future functions (engine shutdown).
  void close();
  int fd() const { return efd_.get(); }

 private:
  UniqueFd efd_;
  std::mutex mu_;  // guards everything below
  std::deque<std::function<void()>> queue_;
  // True when an eventfd write has been made for work queued since the last
  // take(): further cross-thread posts need not write again.
  bool wake_pending_ = false;
  bool closed_ = false;
};

}  // namespace qcowfs::io
