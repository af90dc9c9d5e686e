// ThreadPool: a fixed set of worker threads running queued jobs in FIFO order.
// Used for work that would block an event-loop thread: IoRequest::Op::call
// (io::offload), and every request of ThreadEngine. Jobs report back to their
// engine through Engine::post(); the pool never resumes coroutines itself.
//
// Thread-safety: submit() may be called from any thread. The destructor stops
// accepting jobs, finishes the queued ones and joins the workers.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace qcowfs::io {

class ThreadPool {
 public:
  explicit ThreadPool(size_t threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  void submit(std::function<void()> job);
  size_t size() const { return workers_.size(); }

  // The process-wide pool shared by all engines, created on first use with
  // max(8, 2 * hardware threads) workers (blocking host I/O needs more threads
  // than cores to keep a device busy).
  static ThreadPool& shared();

 private:
  void worker_loop();

  std::mutex mu_;  // guards jobs_ and stopping_
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace qcowfs::io
