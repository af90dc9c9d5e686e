// Daemonizing the FUSE way: fork before any thread or io_uring exists; the
// parent waits until the child reports "mounted" (exit 0) or an error message
// (printed, exit 1) through a pipe, so `qcowfs IMAGE DIR` returns only once
// the mount is usable or has failed.
// Thread-safety: call daemonize() while the process is single-threaded; the
// Reporter belongs to the child's main thread.
#pragma once

#include <string>

#include "io/fd.h"
#include "io/status.h"

namespace qcowfs::fuse {

class DaemonReporter {
 public:
  DaemonReporter() = default;  // foreground: reports go nowhere
  explicit DaemonReporter(io::UniqueFd pipe) : pipe_(std::move(pipe)) {}

  bool is_daemon() const { return pipe_.valid(); }
  // The mount is up: detach from the terminal (stdio to /dev/null) and let
  // the parent exit 0.
  void report_mounted();
  // Startup failed: the parent prints message and exits 1.
  void report_error(const std::string& message);

 private:
  io::UniqueFd pipe_;
};

// Forks. Returns in the child (a new session) with a Reporter; the parent
// never returns: it exits with the child's report. Errors (pipe, fork) are
// returned in the calling process.
Result<DaemonReporter> daemonize();

}  // namespace qcowfs::fuse
