// HttpClient: ranged GETs of one HTTP(S) object on dedicated network threads,
// each running a libcurl multi handle, so no event-loop thread ever waits for
// the network. Connections are kept alive and reused (at most `connections` of
// them, split between the remote-threads= threads); requests past that wait in libcurl's
// queue. A request goes to the thread with the fewest bytes in flight (a
// retry stays on its thread). Several threads let the receive copies (socket
// -> libcurl's buffer -> the request's buffers) of one sequential stream run
// on several CPUs: one thread was the bottleneck of a fast network. A request
// fills several buffers in order (one range for adjacent cache blocks),
// straight from libcurl's receive buffer; curl handles are reused, not made
// per request.
//
// Identity: open() fetches the first block (block_size bytes; two bytes after
// a 416 or a server too slow to send a block in time) and pins the object's size, ETag
// and Last-Modified. Every later response must carry the same (a 206 whose
// Content-Range names the same total and range): a changed object fails the
// request with EIO and one log line naming the URL, never mixed bytes.
//
// Failures: connection errors, timeouts, truncated bodies and 5xx/408/429
// answers are retried with exponential backoff until the request's deadline
// (timeout_ms after it was made); then it fails with EIO. Other answers fail
// at once (404: ENOENT, 401/403: EACCES, TLS errors: EIO with curl's reason;
// an S3 server's answer adds the error code and message of its XML body).
//
// Thread-safety: get_range() may be called from any thread; `done` runs on
// one of the network threads. The destructor fails transfers still under way
// with ECANCELED and joins the threads.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "io/remote/remote_options.h"
#include "io/remote/remote_stats.h"
#include "io/status.h"

struct curl_slist;

namespace qcowfs::io {

struct HttpIdentity {
  uint64_t size = 0;
  std::string etag;
  std::string last_modified;
};

class HttpClient {
 public:
  using Done = std::function<void(Status)>;
  // Buffers filled one after another (io::BlockCache::Buffers).
  using Buffers = std::vector<std::span<std::byte>>;
  struct Transfer;

  // Starts the network threads and pins the object's identity (blocks the
  // calling thread for that first request only).
  static Result<std::unique_ptr<HttpClient>> open(const std::string& url, const RemoteOptions& opts);
  ~HttpClient();
  HttpClient(const HttpClient&) = delete;
  HttpClient& operator=(const HttpClient&) = delete;

  // Fetches [off, off + total size of dst) into dst's buffers in order;
  // done(status) once, on one of the network threads.
  void get_range(uint64_t off, Buffers dst, Done done);

  const HttpIdentity& identity() const { return identity_; }
  // The object's first bytes (up to block_size) fetched by open(), handed
  // over once (empty after, or when open() fell back to a 2-byte probe).
  std::vector<std::byte> take_first_block() { return std::move(first_block_); }
  // The URL as logs and messages show it (io::printable_remote_location).
  const std::string& printable_url() const { return printable_url_; }
  // Requests, retries, errors, bytes fetched and bytes in flight (io/remote/remote_stats.h).
  const RemoteCounters& counters() const { return counters_; }
  // Requests sent (each attempt counts) by each network thread.
  std::vector<uint64_t> requests_per_thread() const;

 private:
  // One network thread: its multi handle, queue and transfers.
  struct Worker;

  HttpClient(std::string url, RemoteOptions opts);
  Status start();
  // open()'s identity request of [0, length) into buf; waits for it.
  Status probe(size_t length, std::byte* buf);
  void submit(std::unique_ptr<Transfer> t);
  // The worker with the fewest bytes in flight.
  Worker& pick_worker();
  void run(Worker& w);
  void start_attempt(Worker& w, std::unique_ptr<Transfer> t);
  void complete(Worker& w, Transfer* t, int curl_code);
  Status check_response(Transfer& t, long http_code, bool* transient);
  Status s3_refusal(const Transfer& t, long http_code) const;
  void fail_all(Worker& w, const Status& st);
  // Calls t's done once, after counting it.
  void deliver(Transfer& t, Status st);

  const std::string url_;
  const std::string printable_url_;
  const RemoteOptions opts_;
  HttpIdentity identity_;  // set by open() before any other request
  long probe_http_code_ = 0;  // the last identity request's HTTP status and bytes received (open())
  size_t probe_received_ = 0;
  std::vector<std::byte> first_block_;  // open()'s, until take_first_block()
  std::atomic<bool> change_logged_{false};
  RemoteCounters counters_;

  ::curl_slist* headers_ = nullptr;  // set by start(), read-only after
  std::vector<std::unique_ptr<Worker>> workers_;  // made by start()
  std::atomic<unsigned> next_worker_{0};  // round-robin among equally loaded workers
};

}  // namespace qcowfs::io
