// RemoteStats: what a user can see of each remote image file (an HttpFile or
// an NbdFile): its identity, its settings and its counters (cache hits and
// misses, read ahead, bytes fetched, requests, retries, errors, reconnects).
//
// Each remote file keeps its counters as atomics (RemoteCounters) and
// registers itself in a process-wide list for its lifetime
// (RemoteStatsRegistration); remote_stats_snapshot() copies every registered
// file's numbers, for the daemon's SIGUSR1 log lines and its status file.
// Thread-safety: counters are relaxed atomics, bumped from any thread; the
// registry is guarded by a mutex, held while a source describes itself (a
// source unregisters before it destroys what describe() reads).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace qcowfs::io {

// One remote file's numbers at one moment.
struct RemoteStatsSnapshot {
  std::string url;            // as logged: without a query (a presigned URL's signature)
  std::string protocol;       // "http", "s3" or "nbd"
  uint64_t size = 0;
  std::string etag;           // http/s3: the identity pinned at open
  std::string last_modified;
  std::string settings;       // block size, cache, readahead, timeout, ... as one line
  // The in-memory block cache (http/s3; zero for nbd, which has none).
  uint64_t cache_hits = 0;    // blocks found cached or already being fetched
  uint64_t cache_misses = 0;  // blocks a read had to fetch
  uint64_t readahead_blocks = 0;
  uint64_t readahead_bytes = 0;  // blocks read ahead x the block size
  // The network.
  uint64_t requests = 0;      // requests sent (each retry counts)
  uint64_t retries = 0;       // attempts repeated after a transient failure
  uint64_t errors = 0;        // requests that failed for good (the reader saw an error)
  uint64_t bytes_fetched = 0; // payload bytes received
  uint64_t bytes_written = 0; // nbd: payload bytes sent
  uint64_t in_flight_bytes = 0;  // buffers of requests under way now
  uint64_t reconnects = 0;    // nbd: connections made again after one was lost
  std::vector<uint64_t> requests_per_thread;  // http/s3: requests sent by each network thread
};

// The network counters a client bumps (relaxed: they are statistics).
struct RemoteCounters {
  std::atomic<uint64_t> requests{0};
  std::atomic<uint64_t> retries{0};
  std::atomic<uint64_t> errors{0};
  std::atomic<uint64_t> bytes_fetched{0};
  std::atomic<uint64_t> bytes_written{0};
  std::atomic<uint64_t> in_flight_bytes{0};
  std::atomic<uint64_t> reconnects{0};

  static void add(std::atomic<uint64_t>& c, uint64_t n = 1) { c.fetch_add(n, std::memory_order_relaxed); }
  static void sub(std::atomic<uint64_t>& c, uint64_t n) { c.fetch_sub(n, std::memory_order_relaxed); }
  // Copies the counters into s (the other fields are the source's).
  void fill(RemoteStatsSnapshot& s) const;
};

// Registers describe for its lifetime; describe runs under the registry's lock.
class RemoteStatsRegistration {
 public:
  using Describe = std::function<RemoteStatsSnapshot()>;
  RemoteStatsRegistration() = default;
  explicit RemoteStatsRegistration(Describe describe);
  ~RemoteStatsRegistration() { reset(); }
  RemoteStatsRegistration(const RemoteStatsRegistration&) = delete;
  RemoteStatsRegistration& operator=(const RemoteStatsRegistration&) = delete;
  // Unregisters now (waits for a snapshot under way).
  void reset();

 private:
  uint64_t id_ = 0;  // 0: not registered
};

// Every registered remote file, in the order they were opened.
std::vector<RemoteStatsSnapshot> remote_stats_snapshot();

// One log line of s's counters: "URL: 12 hits, 3 misses, ...".
std::string format_remote_counters(const RemoteStatsSnapshot& s);
// One log line of s's identity and settings: "URL: 4194304 bytes, ETag ..., ...".
std::string format_remote_identity(const RemoteStatsSnapshot& s);

}  // namespace qcowfs::io
