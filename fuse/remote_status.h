// What the daemon tells of its remote images (io/remote/remote_stats.h):
//   - at mount, one log line per remote file: its size, identity (ETag,
//     Last-Modified) and settings (block size, cache, readahead, timeout, ...);
//   - on SIGUSR1, one log line per remote file with its counters;
//   - with -o status-file=PATH, a JSON file rewritten at mount, on SIGUSR1,
//     every kStatusIntervalMs while mounted and at unmount. It is written to
//     PATH.tmp and renamed over PATH, so a reader never sees half of one.
//     Fields: "pid", "image", "mountpoint", "sequence" (counts the writes),
//     "time" (UTC, ISO 8601), "remotes": one object per remote file with the
//     fields of RemoteStatsSnapshot ("url", "protocol", "size", "etag",
//     "last_modified", "settings", "cache_hits", "cache_misses",
//     "readahead_blocks", "readahead_bytes", "requests", "retries", "errors",
//     "bytes_fetched", "bytes_written", "in_flight_bytes", "reconnects").
// Thread-safety: the Reporter belongs to the main thread.
#pragma once

#include <cstdint>
#include <string>

#include "io/status.h"

namespace qcowfs::fuse {

constexpr int kStatusIntervalMs = 5000;

class RemoteStatusReporter {
 public:
  // status_file: "" for none (absolute otherwise).
  RemoteStatusReporter(std::string image, std::string mountpoint, std::string status_file);

  bool has_status_file() const { return !status_file_.empty(); }
  // The first status file (a failure fails the mount).
  Status at_mount();
  // One log line per remote file: identity and settings.
  void log_identities();
  // SIGUSR1: the counters to the log, and the status file.
  void on_signal();
  // Periodic and final rewrites of the status file (failures logged once).
  void refresh();

 private:
  Status write_status_file();

  std::string image_, mountpoint_, status_file_;
  uint64_t sequence_ = 0;
  bool failure_logged_ = false;
};

}  // namespace qcowfs::fuse
