// Helpers for the tools unit tests: running a Task whose I/O completes
// synchronously (MemFile-backed) without an Engine.
#pragma once

#include <optional>
#include <type_traits>

#include <gtest/gtest.h>

#include "io/task.h"

namespace qcowfs::tools_testing {

// Runs t to completion; MemFile I/O never suspends, so it must be done at once.
template <typename T>
T run_now(Task<T> t) {
  std::optional<T> out;
  spawn_then(std::move(t), [&](T v) { out.emplace(std::move(v)); });
  EXPECT_TRUE(out.has_value()) << "task suspended: it was expected to complete synchronously";
  return std::move(*out);
}

}  // namespace qcowfs::tools_testing
