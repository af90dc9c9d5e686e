#include "io/remote/http_client.h"

#include <curl/curl.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <future>

#include <pthread.h>

#include "io/log.h"
#include "io/remote/canonical_url.h"
#include "io/remote/lazy_library.h"
#include "io/remote/s3.h"

namespace qcowfs::io {

using Clock = std::chrono::steady_clock;

struct HttpClient::Transfer {
  uint64_t off = 0;
  Buffers dst;
  size_t length = 0;    // of dst, together
  size_t received = 0;
  size_t part = 0;      // the buffer of dst being filled, and bytes into it
  size_t part_off = 0;
  bool overflow = false;
  bool probe = false;  // open(): records the identity instead of checking it
  Done done;
  Worker* worker = nullptr;  // the network thread it runs on (set by submit())
  Clock::time_point deadline;
  Clock::time_point retry_at;
  unsigned attempts = 0;
  Status last_error;
  CURL* easy = nullptr;
  char errbuf[CURL_ERROR_SIZE] = {};
  std::string range;
  std::string error_body;  // the start of a 4xx/5xx answer's body (an S3 error's XML)
};

struct HttpClient::Worker {
  void* multi = nullptr;  // CURLM*, used on this worker's thread (and wakeup)
  unsigned connections = 1;
  std::atomic<uint64_t> in_flight{0};  // bytes of its transfers not yet delivered
  std::atomic<uint64_t> requests{0};   // attempts started

  std::mutex mu;  // guards incoming and stopping
  std::deque<std::unique_ptr<Transfer>> incoming;
  bool stopping = false;

  // This worker's thread only.
  std::unordered_set<Transfer*> active;
  std::vector<void*> idle_easy;  // CURL* handles done with, for the next requests
  std::vector<std::unique_ptr<Transfer>> waiting_retry;
  std::thread thread;
};

namespace {

void init_curl_once() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

constexpr size_t kMaxErrorBody = 8192;
// libcurl's receive buffer (its default is 16 KiB): fewer recv calls and
// callbacks per request of a megabyte (not more: it is allocated per transfer,
// and 512 KiB cost 45% more daemon CPU per GiB read; 128 and 256 KiB no
// less than 64: bench/RESULTS.md).
constexpr long kReceiveBuffer = 64 * 1024;
// Idle curl handles kept for reuse beyond the connections.
constexpr size_t kSpareHandles = 4;

// The body of a 206 goes into the transfer's buffer; of an error answer the
// first kMaxErrorBody bytes are kept (for its message); other bodies are dropped.
size_t http_write_body(char* data, size_t size, size_t n, void* user) {
  auto* t = static_cast<HttpClient::Transfer*>(user);
  const size_t len = size * n;
  long code = 0;
  curl_easy_getinfo(t->easy, CURLINFO_RESPONSE_CODE, &code);
  if (code >= 400 && t->error_body.size() < kMaxErrorBody)
    t->error_body.append(data, std::min(len, kMaxErrorBody - t->error_body.size()));
  if (code != 206) return len;
  if (t->received + len > t->length) {
    t->overflow = true;
    return 0;  // aborts the transfer (CURLE_WRITE_ERROR)
  }
  for (size_t left = len; left > 0;) {
    std::span<std::byte> part = t->dst[t->part];
    const size_t take = std::min(left, part.size() - t->part_off);
    std::memcpy(part.data() + t->part_off, data + (len - left), take);
    left -= take;
    t->part_off += take;
    if (t->part_off == part.size()) {
      ++t->part;
      t->part_off = 0;
    }
  }
  t->received += len;
  return len;
}

std::string response_header(CURL* easy, const char* name) {
  struct curl_header* h = nullptr;
  if (curl_easy_header(easy, name, 0, CURLH_HEADER, -1, &h) != CURLHE_OK || !h) return {};
  return h->value;
}

// "bytes FIRST-LAST/TOTAL"
bool parse_content_range(const std::string& v, uint64_t& first, uint64_t& last, uint64_t& total) {
  unsigned long long a = 0, b = 0, c = 0;
  if (std::sscanf(v.c_str(), "bytes %llu-%llu/%llu", &a, &b, &c) != 3) return false;
  first = a;
  last = b;
  total = c;
  return true;
}

bool transient_curl_error(CURLcode rc) {
  switch (rc) {
    case CURLE_COULDNT_CONNECT:
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_OPERATION_TIMEDOUT:
    case CURLE_GOT_NOTHING:
    case CURLE_SEND_ERROR:
    case CURLE_RECV_ERROR:
    case CURLE_PARTIAL_FILE:
    case CURLE_HTTP2:
    case CURLE_HTTP2_STREAM:
      return true;
    default:
      return false;
  }
}

int errno_of_http(long code) {
  if (code == 404 || code == 410) return ENOENT;
  if (code == 401 || code == 403) return EACCES;
  return EIO;
}

bool transient_http(long code) { return code == 408 || code == 429 || code >= 500; }

std::chrono::milliseconds backoff(unsigned attempts) {
  return std::chrono::milliseconds(std::min<int64_t>(2000, int64_t{50} << std::min(attempts, 6u)));
}

}  // namespace

HttpClient::HttpClient(std::string url, RemoteOptions opts)
    : url_(std::move(url)), printable_url_(printable_remote_location(url_)), opts_(std::move(opts)) {}

HttpClient::~HttpClient() {
  for (auto& w : workers_) {
    {
      std::lock_guard lk(w->mu);
      w->stopping = true;
    }
    curl_multi_wakeup(static_cast<CURLM*>(w->multi));
  }
  for (auto& w : workers_) {
    if (w->thread.joinable()) w->thread.join();
    for (void* e : w->idle_easy) curl_easy_cleanup(static_cast<CURL*>(e));
    curl_multi_cleanup(static_cast<CURLM*>(w->multi));
  }
  curl_slist_free_all(headers_);
}

std::vector<uint64_t> HttpClient::requests_per_thread() const {
  std::vector<uint64_t> n;
  for (const auto& w : workers_) n.push_back(w->requests.load(std::memory_order_relaxed));
  return n;
}

Status HttpClient::probe(size_t length, std::byte* buf) {
  auto t = std::make_unique<Transfer>();
  t->dst = {std::span<std::byte>(buf, length)};
  t->length = length;
  t->probe = true;
  std::promise<Status> result;
  t->done = [&result](Status st) { result.set_value(std::move(st)); };
  auto fut = result.get_future();
  submit(std::move(t));
  return fut.get();
}

Result<std::unique_ptr<HttpClient>> HttpClient::open(const std::string& url, const RemoteOptions& opts) {
  init_curl_once();
  std::unique_ptr<HttpClient> c(new HttpClient(url, opts));
  QCOWFS_TRY(c->start());
  // The identity request also fetches the first block (what a mount reads
  // first: probe, header, often L1), saving a round trip at mount.
  if (opts.block_size >= 2) {
    std::vector<std::byte> block(opts.block_size);
    Status st = c->probe(block.size(), block.data());
    if (st) {
      block.resize(std::min<uint64_t>(block.size(), c->identity_.size));
      c->first_block_ = std::move(block);
      return c;
    }
    // 416 (an object smaller than asked for, on a server that will not shorten the range), or a
    // server too slow to send a block within remote-timeout (some bytes came): two bytes, as before.
    if (c->probe_http_code_ != 416 && (st.code() != EIO || c->probe_received_ == 0)) return st;
    log::debug("{}: fetching the first block at open failed ({}); pinning the identity with 2 bytes",
               c->printable_url_, st.message());
  }
  // Two bytes, not one: some servers (s3rver) answer "bytes=0-0" with the whole object.
  std::byte first[2] = {};
  QCOWFS_TRY(c->probe(2, first));
  return c;
}

Status HttpClient::start() {
  if (!curl_library().loaded()) return Status::errorf(ELIBACC, "{}: {}", printable_url_, curl_library().error());
  for (const std::string& h : opts_.headers) headers_ = curl_slist_append(headers_, h.c_str());
  // Each thread its share of the connections (a thread without one would idle).
  const unsigned threads = std::clamp(opts_.network_threads, 1u, std::max(1u, opts_.connections));
  for (unsigned i = 0; i < threads; ++i) {
    CURLM* m = curl_multi_init();
    if (!m) return Status::errorf(ENOMEM, "{}: cannot make a curl multi handle", printable_url_);
    auto w = std::make_unique<Worker>();
    w->multi = m;
    w->connections = opts_.connections / threads + (i < opts_.connections % threads ? 1 : 0);
    const long conns = static_cast<long>(w->connections);
    curl_multi_setopt(m, CURLMOPT_MAX_HOST_CONNECTIONS, conns);
    curl_multi_setopt(m, CURLMOPT_MAX_TOTAL_CONNECTIONS, conns);
    curl_multi_setopt(m, CURLMOPT_MAXCONNECTS, conns);
    workers_.push_back(std::move(w));
  }
  for (auto& w : workers_) {
    w->thread = std::thread([this, wp = w.get()] { run(*wp); });
    pthread_setname_np(w->thread.native_handle(), "qcowfs-net");  // top -H, perf --per-thread
  }
  return Status::ok();
}

void HttpClient::get_range(uint64_t off, Buffers dst, Done done) {
  auto t = std::make_unique<Transfer>();
  t->off = off;
  for (const auto& d : dst) t->length += d.size();
  t->dst = std::move(dst);
  t->done = std::move(done);
  submit(std::move(t));
}

HttpClient::Worker& HttpClient::pick_worker() {
  const unsigned n = static_cast<unsigned>(workers_.size());
  const unsigned first = next_worker_.fetch_add(1, std::memory_order_relaxed) % n;
  Worker* best = workers_[first].get();
  for (unsigned k = 1; k < n; ++k) {
    Worker* w = workers_[(first + k) % n].get();
    if (w->in_flight.load(std::memory_order_relaxed) < best->in_flight.load(std::memory_order_relaxed)) best = w;
  }
  return *best;
}

void HttpClient::submit(std::unique_ptr<Transfer> t) {
  Worker& w = pick_worker();
  t->worker = &w;
  t->deadline = Clock::now() + std::chrono::milliseconds(opts_.timeout_ms);
  RemoteCounters::add(counters_.in_flight_bytes, t->length);
  RemoteCounters::add(w.in_flight, t->length);
  {
    std::lock_guard lk(w.mu);
    if (!w.stopping) {
      w.incoming.push_back(std::move(t));
      t = nullptr;
    }
  }
  if (t) {
    deliver(*t, Status::errorf(ECANCELED, "{}: the connection is closing", printable_url_));
    return;
  }
  curl_multi_wakeup(static_cast<CURLM*>(w.multi));
}

void HttpClient::start_attempt(Worker& w, std::unique_ptr<Transfer> t) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(t->deadline - Clock::now());
  CURL* e = nullptr;
  if (!w.idle_easy.empty()) {
    e = static_cast<CURL*>(w.idle_easy.back());
    w.idle_easy.pop_back();
  } else {
    e = curl_easy_init();
  }
  if (!e) {
    deliver(*t, Status::errorf(ENOMEM, "{}: cannot make a curl handle", printable_url_));
    return;
  }
  ++t->attempts;
  RemoteCounters::add(counters_.requests);
  RemoteCounters::add(w.requests);
  t->error_body.clear();
  t->received = 0;
  t->part = 0;
  t->part_off = 0;
  t->overflow = false;
  t->errbuf[0] = 0;
  t->easy = e;
  t->range = fmt::format("{}-{}", t->off, t->off + t->length - 1);
  curl_easy_setopt(e, CURLOPT_URL, url_.c_str());
  curl_easy_setopt(e, CURLOPT_RANGE, t->range.c_str());
  curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, http_write_body);
  curl_easy_setopt(e, CURLOPT_WRITEDATA, t.get());
  curl_easy_setopt(e, CURLOPT_PRIVATE, t.get());
  curl_easy_setopt(e, CURLOPT_ERRORBUFFER, t->errbuf);
  curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(e, CURLOPT_BUFFERSIZE, kReceiveBuffer);
  curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, static_cast<long>(std::max<int64_t>(1, left.count())));
  curl_easy_setopt(e, CURLOPT_FOLLOWLOCATION, 1L);
  curl_easy_setopt(e, CURLOPT_MAXREDIRS, 5L);
  curl_easy_setopt(e, CURLOPT_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(e, CURLOPT_REDIR_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(e, CURLOPT_USERAGENT, "qcowfs");
  curl_easy_setopt(e, CURLOPT_PIPEWAIT, 1L);
  curl_easy_setopt(e, CURLOPT_SSL_VERIFYPEER, opts_.ssl_verify ? 1L : 0L);
  curl_easy_setopt(e, CURLOPT_SSL_VERIFYHOST, opts_.ssl_verify ? 2L : 0L);
  if (!opts_.ca_file.empty()) curl_easy_setopt(e, CURLOPT_CAINFO, opts_.ca_file.c_str());
  if (headers_) curl_easy_setopt(e, CURLOPT_HTTPHEADER, headers_);
  if (!opts_.aws_sigv4.empty()) {
    curl_easy_setopt(e, CURLOPT_AWS_SIGV4, opts_.aws_sigv4.c_str());
    curl_easy_setopt(e, CURLOPT_USERPWD, opts_.aws_userpwd.c_str());
    curl_easy_setopt(e, CURLOPT_PATH_AS_IS, 1L);  // a key's "." and ".." segments are its own (io/remote/s3.h)
  }
  w.active.insert(t.get());
  curl_multi_add_handle(static_cast<CURLM*>(w.multi), e);
  t.release();  // owned through active_ until complete()
}

Status HttpClient::check_response(Transfer& t, long code, bool* transient) {
  *transient = false;
  if (t.probe) probe_http_code_ = code;  // read by open() after the request
  if (code != 206) {
    *transient = transient_http(code);
    if (code == 200) return Status::errorf(EIO, "{}: the server ignores range requests (HTTP 200)", printable_url_);
    if (code == 412) return Status::errorf(EIO, "{}: the object changed on the server (HTTP 412)", printable_url_);
    if (!opts_.aws_sigv4.empty()) return s3_refusal(t, code);
    return Status::errorf(errno_of_http(code), "{}: HTTP {}", printable_url_, code);
  }
  uint64_t first = 0, last = 0, total = 0;
  if (!parse_content_range(response_header(t.easy, "Content-Range"), first, last, total))
    return Status::errorf(EIO, "{}: a 206 answer without a Content-Range", printable_url_);
  if (t.probe) {
    // The only request before open() returns, which reads identity_ after it.
    identity_.size = total;
    identity_.etag = response_header(t.easy, "ETag");
    identity_.last_modified = response_header(t.easy, "Last-Modified");
  } else {
    const std::string etag = response_header(t.easy, "ETag");
    const std::string modified = response_header(t.easy, "Last-Modified");
    if (total != identity_.size || etag != identity_.etag || modified != identity_.last_modified) {
      if (!change_logged_.exchange(true))
        log::error("{}: the object changed on the server since it was opened (size {} -> {}, ETag {} -> {}, "
                   "Last-Modified {} -> {}); its reads fail with EIO",
                   printable_url_, identity_.size, total, identity_.etag, etag, identity_.last_modified, modified);
      return Status::errorf(EIO, "{}: the object changed on the server since it was opened", printable_url_);
    }
  }
  const uint64_t want_last = t.off + t.length - 1;
  if (first != t.off || last != std::min(want_last, total ? total - 1 : 0))
    return Status::errorf(EIO, "{}: asked for bytes {}, got {}-{}", printable_url_, t.range, first, last);
  if (t.received != last - first + 1) {
    *transient = true;
    return Status::errorf(EIO, "{}: truncated answer ({} of {} bytes)", printable_url_, t.received, last - first + 1);
  }
  return Status::ok();
}

// An S3 server's refusal, with the code and message of its XML body.
Status HttpClient::s3_refusal(const Transfer& t, long code) const {
  std::string summary = s3_error_summary(t.error_body);
  if (!summary.empty()) summary = " " + summary;
  if (code == 401 || code == 403)
    return Status::errorf(EACCES, "{}: HTTP {}{}: the S3 server refused the credentials or the request "
                          "(keys from {}, region {})", printable_url_, code, summary, opts_.aws_credential_source,
                          opts_.s3_region);
  return Status::errorf(errno_of_http(code), "{}: HTTP {}{}", printable_url_, code, summary);
}

void HttpClient::deliver(Transfer& t, Status st) {
  if (t.probe) probe_received_ = t.received;  // read by open() after done
  RemoteCounters::sub(counters_.in_flight_bytes, t.length);
  RemoteCounters::sub(t.worker->in_flight, t.length);
  if (st) RemoteCounters::add(counters_.bytes_fetched, t.received);
  else if (st.code() != ECANCELED) RemoteCounters::add(counters_.errors);
  t.done(std::move(st));
}

void HttpClient::complete(Worker& w, Transfer* raw, int curl_code) {
  std::unique_ptr<Transfer> t(raw);
  w.active.erase(raw);
  const auto rc = static_cast<CURLcode>(curl_code);
  long code = 0;
  curl_easy_getinfo(t->easy, CURLINFO_RESPONSE_CODE, &code);
  bool transient = false;
  Status st;
  if (rc == CURLE_OK) {
    st = check_response(*t, code, &transient);
  } else {
    transient = transient_curl_error(rc) && !t->overflow;
    st = Status::errorf(EIO, "{}: {}", printable_url_, t->errbuf[0] ? t->errbuf : curl_easy_strerror(rc));
  }
  curl_multi_remove_handle(static_cast<CURLM*>(w.multi), t->easy);
  if (w.idle_easy.size() < w.connections + kSpareHandles) w.idle_easy.push_back(t->easy);
  else curl_easy_cleanup(t->easy);
  t->easy = nullptr;
  if (st) {
    deliver(*t, Status::ok());
    return;
  }
  const auto now = Clock::now();
  if (transient && now + backoff(t->attempts) < t->deadline) {
    log::debug("{}: retrying bytes {} after: {}", printable_url_, t->range, st.message());
    RemoteCounters::add(counters_.retries);
    t->retry_at = now + backoff(t->attempts);
    t->last_error = std::move(st);
    w.waiting_retry.push_back(std::move(t));
    return;
  }
  if (transient) {
    st = Status::errorf(EIO, "{} (gave up after {} attempts in {} s)", st.message(), t->attempts,
                        opts_.timeout_ms / 1000);
  }
  deliver(*t, std::move(st));
}

void HttpClient::run(Worker& w) {
  auto* m = static_cast<CURLM*>(w.multi);
  while (true) {
    std::deque<std::unique_ptr<Transfer>> fresh;
    {
      std::lock_guard lk(w.mu);
      if (w.stopping) break;
      fresh.swap(w.incoming);
    }
    for (auto& t : fresh) start_attempt(w, std::move(t));
    const auto now = Clock::now();
    auto due = std::partition(w.waiting_retry.begin(), w.waiting_retry.end(),
                              [&](const std::unique_ptr<Transfer>& t) { return t->retry_at > now; });
    std::vector<std::unique_ptr<Transfer>> ready(std::make_move_iterator(due),
                                                 std::make_move_iterator(w.waiting_retry.end()));
    w.waiting_retry.erase(due, w.waiting_retry.end());
    for (auto& t : ready) start_attempt(w, std::move(t));

    int running = 0;
    curl_multi_perform(m, &running);
    int left = 0;
    while (CURLMsg* msg = curl_multi_info_read(m, &left)) {
      if (msg->msg != CURLMSG_DONE) continue;
      void* priv = nullptr;
      curl_easy_getinfo(msg->easy_handle, CURLINFO_PRIVATE, &priv);
      complete(w, static_cast<Transfer*>(priv), msg->data.result);
    }
    int wait_ms = 1000;
    for (const auto& t : w.waiting_retry) {
      auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(t->retry_at - Clock::now()).count();
      wait_ms = std::clamp<int>(static_cast<int>(ms) + 1, 0, wait_ms);
    }
    curl_multi_poll(m, nullptr, 0, wait_ms, nullptr);
  }
  fail_all(w, Status::errorf(ECANCELED, "{}: the connection is closing", printable_url_));
}

void HttpClient::fail_all(Worker& w, const Status& st) {
  auto* m = static_cast<CURLM*>(w.multi);
  for (Transfer* raw : w.active) {
    std::unique_ptr<Transfer> t(raw);
    curl_multi_remove_handle(m, t->easy);
    curl_easy_cleanup(t->easy);
    deliver(*t, st);
  }
  w.active.clear();
  for (auto& t : w.waiting_retry) deliver(*t, st);
  w.waiting_retry.clear();
  std::deque<std::unique_ptr<Transfer>> rest;
  {
    std::lock_guard lk(w.mu);
    rest.swap(w.incoming);
  }
  for (auto& t : rest) deliver(*t, st);
}

}  // namespace qcowfs::io
