// run_sync(): drives a Task to completion on the calling thread's engine (or a
// given one), for code that is not itself a coroutine: opening an image before
// the mount starts, command-line tools, unit tests.
// Thread-safety: the engine must belong to the calling thread.
#pragma once

#include <optional>
#include <type_traits>

#include "io/engine.h"
#include "io/task.h"

namespace qcowfs::io {

template <typename T>
T run_sync(Engine& engine, Task<T> task) {
  ScopedEngine scope(&engine);
  bool done = false;
  if constexpr (std::is_void_v<T>) {
    spawn_then(std::move(task), [&] { done = true; });
    while (!done) engine.run_once(-1);
  } else {
    std::optional<T> out;
    spawn_then(std::move(task), [&](T v) {
      out.emplace(std::move(v));
      done = true;
    });
    while (!done) engine.run_once(-1);
    return std::move(*out);
  }
}

}  // namespace qcowfs::io
