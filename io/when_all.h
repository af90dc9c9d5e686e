// when_all(): runs several Task<Status> concurrently on the calling thread and
// completes when all of them have, with the first failure (or ok). Used to
// issue every host read of one request together.
// Thread-safety: the tasks start on the calling thread; they may complete on
// any thread (the bookkeeping is atomic) and the awaiting coroutine is resumed
// on its own Engine.
#pragma once

#include <atomic>
#include <mutex>
#include <vector>

#include "io/status.h"
#include "io/sync.h"
#include "io/task.h"

namespace qcowfs::io {

inline Task<Status> when_all(std::vector<Task<Status>> tasks) {
  if (tasks.empty()) co_return Status::ok();
  if (tasks.size() == 1) co_return co_await std::move(tasks.front());
  struct State {
    std::atomic<size_t> remaining;
    std::mutex mu;  // guards first_error
    Status first_error;
    AsyncEvent done;
  } st;
  st.remaining.store(tasks.size());
  for (auto& t : tasks) {
    spawn_then(std::move(t), [&st](Status s) {
      if (!s.is_ok()) {
        std::lock_guard lk(st.mu);
        if (st.first_error.is_ok()) st.first_error = std::move(s);
      }
      if (st.remaining.fetch_sub(1) == 1) st.done.set();
    });
  }
  co_await st.done.wait();
  std::lock_guard lk(st.mu);
  co_return st.first_error;
}

}  // namespace qcowfs::io
