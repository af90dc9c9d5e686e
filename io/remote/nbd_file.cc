#include "io/remote/nbd_file.h"

#include <libnbd.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "io/log.h"
#include "io/remote/lazy_library.h"
#include "io/remote/read_iov.h"
#include "io/sync.h"
#include "io/when_all.h"

namespace qcowfs::io {

// One command in flight: the coroutine that issued it waits on `done`.
struct NbdFile::Op {
  AsyncEvent done;
  int err = 0;
  std::vector<std::pair<uint64_t, bool>> extents;  // block status: (length, is a hole)

  static int on_done(void* user, int* error) {
    auto* op = static_cast<Op*>(user);
    op->err = *error;
    op->done.set();
    return 1;  // retire the command
  }
  static int on_extents(void* user, const char* context, uint64_t, uint32_t* entries, size_t n, int*) {
    auto* op = static_cast<Op*>(user);
    if (std::string_view(context) != LIBNBD_CONTEXT_BASE_ALLOCATION) return 0;
    for (size_t i = 0; i + 1 < n; i += 2) op->extents.emplace_back(entries[i], (entries[i + 1] & LIBNBD_STATE_HOLE) != 0);
    return 0;
  }
};

namespace {

constexpr uint64_t kNbdMaxRequest = 32u << 20;     // what every server accepts
constexpr uint64_t kNbdMaxStatusSpan = 1u << 30;   // block status asked per command
static_assert(2 * kNbdReadPiece <= kNbdMaxRequest);  // NbdFile::read's single command

// Acknowledges at once what the server sent. qemu-nbd (7.2) writes an option
// reply's header and its payload in two small writes, and its Nagle holds the
// second until our ACK of the first, which Linux delays by 40 ms in
// interactive mode: twice per handshake (meta context, go). TCP_QUICKACK sends
// a pending ACK now; the handshake then takes its round trips only. Harmless
// (and failing) on a unix socket.
void ack_now(int fd) {
  const int one = 1;
  if (fd >= 0) (void)::setsockopt(fd, IPPROTO_TCP, TCP_QUICKACK, &one, sizeof one);
}

// Connects h to uri and negotiates, asynchronously so that it is bounded:
// until the handle is ready, dies, `deadline` passes or *stopping (if given) is
// set (a write to wake_fd interrupts the wait to look). False, the reason in
// *why and an errno in *err, when not ready.
bool handshake(nbd_handle* h, const std::string& uri, int wake_fd, std::chrono::steady_clock::time_point deadline,
               const std::atomic<bool>* stopping, std::string* why, int* err) {
  *err = 0;
  // libnbd zeroes every read buffer before the read by default (for callers
  // that look at a failed read's buffer); a failed read here is an error, its
  // buffer unused, so that is a memset of every byte read for nothing.
  nbd_set_pread_initialize(h, false);
  if (nbd_aio_connect_uri(h, uri.c_str()) == 0) {
    while (!(stopping && stopping->load()) && nbd_aio_is_ready(h) != 1 && nbd_aio_is_dead(h) != 1 &&
           nbd_aio_is_closed(h) != 1) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) break;
      const int fd = nbd_aio_get_fd(h);
      const unsigned dir = nbd_aio_get_direction(h);
      ack_now(fd);
      pollfd p[2] = {{fd, 0, 0}, {wake_fd, POLLIN, 0}};
      if (dir & LIBNBD_AIO_DIRECTION_READ) p[0].events |= POLLIN;
      if (dir & LIBNBD_AIO_DIRECTION_WRITE) p[0].events |= POLLOUT;
      if (::poll(p, 2, static_cast<int>(std::min<int64_t>(left.count(), 1000))) < 0) continue;
      if (fd >= 0 && (p[0].revents & (POLLIN | POLLHUP | POLLERR))) nbd_aio_notify_read(h);
      else if (fd >= 0 && (p[0].revents & POLLOUT)) nbd_aio_notify_write(h);
      if (p[1].revents & POLLIN) {
        uint64_t v;
        [[maybe_unused]] auto n = ::read(wake_fd, &v, sizeof v);
      }
    }
  }
  if (nbd_aio_is_ready(h) == 1) {
    ack_now(nbd_aio_get_fd(h));  // the last reply's ACK too, not 40 ms later
    return true;
  }
  // Refused or failed (libnbd says why), or no answer in time.
  const bool failed = nbd_aio_is_dead(h) == 1 || nbd_aio_is_closed(h) == 1 || nbd_aio_is_created(h) == 1;
  const char* e = nbd_get_error();
  *why = failed && e ? e : "no answer within the timeout";
  *err = failed && nbd_get_errno() ? nbd_get_errno() : EIO;
  return false;
}

}  // namespace

std::vector<ReadPiece> split_read(size_t n, size_t piece, size_t max_request) {
  constexpr size_t kMaxPieces = 16;
  size_t len = max_request;
  if (n >= 2 * piece) {
    const size_t even = ((n + kMaxPieces - 1) / kMaxPieces + 4095) / 4096 * 4096;
    len = std::min(max_request, std::max(piece, even));
  }
  std::vector<ReadPiece> out;
  for (size_t off = 0; off < n; off += len) out.push_back({off, std::min(len, n - off)});
  return out;
}

NbdFile::NbdFile(std::string uri, nbd_handle* h, UniqueFd wake, uint64_t size, bool writable, unsigned timeout_ms)
    : uri_(std::move(uri)), wake_(std::move(wake)), size_(size), writable_(writable), timeout_(timeout_ms), h_(h) {
  can_flush_ = nbd_can_flush(h_) == 1;
  can_trim_ = nbd_can_trim(h_) == 1;
  can_zero_ = nbd_can_zero(h_) == 1;
  can_status_ = nbd_can_meta_context(h_, LIBNBD_CONTEXT_BASE_ALLOCATION) == 1;
  thread_ = std::thread([this] { run(); });
  registration_.emplace([this] { return describe(); });
}

NbdFile::~NbdFile() {
  registration_.reset();
  log::debug("{}", format_remote_counters(describe()));
  stopping_.store(true);
  wake();
  thread_.join();
  if (h_) nbd_close(h_);
}

RemoteStatsSnapshot NbdFile::describe() const {
  RemoteStatsSnapshot s;
  s.url = uri_;
  s.protocol = "nbd";
  s.size = size_;
  s.settings = fmt::format("{}, timeout {} s, server offers flush {}, trim {}, write zeroes {}, block status {}",
                           writable_ ? "read-write" : "read-only", timeout_.count() / 1000, can_flush_ ? "yes" : "no",
                           can_trim_ ? "yes" : "no", can_zero_ ? "yes" : "no", can_status_ ? "yes" : "no");
  counters_.fill(s);
  return s;
}

Result<std::unique_ptr<NbdFile>> NbdFile::open(const std::string& uri, const OpenOptions& opts) {
  auto ro = effective_remote_options(opts.remote);
  if (!ro) return ro.status();
  if (!nbd_library().loaded()) return Status::errorf(ELIBACC, "{}: {}", uri, nbd_library().error());
  nbd_handle* h = nbd_create();
  if (!h) return Status::errorf(ENOMEM, "{}: {}", uri, nbd_get_error());
  auto fail = [&](int err, std::string_view what) {
    Status st = Status::errorf(err ? err : EIO, "{}: {}", uri, what);
    nbd_close(h);
    return st;
  };
  UniqueFd wake(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake.valid()) return fail(errno, "eventfd");
  nbd_add_meta_context(h, LIBNBD_CONTEXT_BASE_ALLOCATION);
  std::string why;
  int err = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(ro->timeout_ms);
  if (!handshake(h, uri, wake.get(), deadline, nullptr, &why, &err)) return fail(err, why);
  const int64_t size = nbd_get_size(h);
  if (size < 0) return fail(nbd_get_errno(), nbd_get_error());
  if (opts.writable && nbd_is_read_only(h) == 1) return fail(EROFS, "the server exports it read-only");
  std::unique_ptr<NbdFile> f(
      new NbdFile(uri, h, std::move(wake), static_cast<uint64_t>(size), opts.writable, ro->timeout_ms));
  log::debug("{}", format_remote_identity(f->describe()));
  return f;
}

void NbdFile::wake() {
  const uint64_t one = 1;
  [[maybe_unused]] auto n = ::write(wake_.get(), &one, sizeof one);
}

void NbdFile::run() {
  while (!stopping_.load()) {
    nbd_handle* h;
    {
      std::lock_guard lk(mu_);
      h = connected_ ? h_ : nullptr;  // h_ changes only on this thread
    }
    if (!h) {
      if (!reconnect()) sleep_until(next_attempt_);
      continue;
    }
    serve_connection(h);
    check_deadlines(h);
    if (nbd_aio_is_dead(h) == 1 || nbd_aio_is_closed(h) == 1) drop_connection(h);
  }
}

void NbdFile::serve_connection(nbd_handle* h) {
  const int fd = nbd_aio_get_fd(h);
  const unsigned dir = nbd_aio_get_direction(h);
  pollfd p[2] = {{fd, 0, 0}, {wake_.get(), POLLIN, 0}};
  if (dir & LIBNBD_AIO_DIRECTION_READ) p[0].events |= POLLIN;
  if (dir & LIBNBD_AIO_DIRECTION_WRITE) p[0].events |= POLLOUT;
  if (::poll(p, 2, 1000) < 0) return;
  if (fd >= 0 && (p[0].revents & (POLLIN | POLLHUP | POLLERR))) {
    nbd_aio_notify_read(h);
  } else if (fd >= 0 && (p[0].revents & POLLOUT)) {
    nbd_aio_notify_write(h);
  }
  if (p[1].revents & POLLIN) {
    uint64_t v;
    [[maybe_unused]] auto n = ::read(wake_.get(), &v, sizeof v);
  }
}

void NbdFile::check_deadlines(nbd_handle* h) {
  std::chrono::steady_clock::time_point oldest;
  {
    std::lock_guard lk(mu_);
    if (in_flight_.empty() || timed_out_.load()) return;
    oldest = std::min_element(in_flight_.begin(), in_flight_.end(),
                              [](const auto& a, const auto& b) { return a.second < b.second; })->second;
  }
  if (std::chrono::steady_clock::now() - oldest < timeout_) return;
  log::error("{}: the server did not answer within {} s; dropping the connection (reads and writes fail "
             "with EIO until it is made again)", uri_, timeout_.count() / 1000);
  timed_out_.store(true);
  // libnbd sees the end of the connection and fails every command in flight.
  const int fd = nbd_aio_get_fd(h);
  if (fd >= 0) ::shutdown(fd, SHUT_RDWR);
}

void NbdFile::drop_connection(nbd_handle* h) {
  if (!timed_out_.load()) {
    const char* why = nbd_get_error();
    log::error("{}: the connection to the server was lost ({}); reads and writes fail with EIO until it is "
               "made again", uri_, why ? why : "closed");
  }
  {
    std::lock_guard lk(mu_);
    connected_ = false;
    h_ = nullptr;
  }
  nbd_close(h);  // dead: libnbd already failed its commands
  backoff_ = std::chrono::milliseconds(0);
  next_attempt_ = std::chrono::steady_clock::now();
  reconnect_failure_logged_ = false;
}

void NbdFile::sleep_until(std::chrono::steady_clock::time_point t) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(t - std::chrono::steady_clock::now());
  if (left.count() <= 0 || stopping_.load()) return;
  pollfd p{wake_.get(), POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(left.count())) > 0) {
    uint64_t v;
    [[maybe_unused]] auto n = ::read(wake_.get(), &v, sizeof v);
  }
}

nbd_handle* NbdFile::connect_once(std::string* why) {
  nbd_handle* h = nbd_create();
  if (!h) {
    *why = nbd_get_error() ? nbd_get_error() : "nbd_create failed";
    return nullptr;
  }
  nbd_add_meta_context(h, LIBNBD_CONTEXT_BASE_ALLOCATION);
  int err = 0;
  if (handshake(h, uri_, wake_.get(), std::chrono::steady_clock::now() + timeout_, &stopping_, why, &err)) {
    const int64_t size = nbd_get_size(h);
    if (size >= 0 && static_cast<uint64_t>(size) == size_ && !(writable_ && nbd_is_read_only(h) == 1)) return h;
    *why = size < 0 ? std::string(nbd_get_error() ? nbd_get_error() : "no size")
                    : fmt::format("the export is now {} bytes{} (it was {})", size,
                                  writable_ && nbd_is_read_only(h) == 1 ? " and read-only" : "", size_);
  }
  nbd_close(h);
  return nullptr;
}

bool NbdFile::reconnect() {
  if (std::chrono::steady_clock::now() < next_attempt_) return false;
  std::string why;
  nbd_handle* h = connect_once(&why);
  if (!h) {
    if (!reconnect_failure_logged_ && !stopping_.load())
      log::warn("{}: cannot connect again yet ({}); retrying with back-off", uri_, why);
    reconnect_failure_logged_ = true;
    backoff_ = std::min<std::chrono::milliseconds>(std::chrono::milliseconds(2000),
                                                   backoff_.count() ? backoff_ * 2 : std::chrono::milliseconds(100));
    next_attempt_ = std::chrono::steady_clock::now() + backoff_;
    return false;
  }
  {
    std::lock_guard lk(mu_);
    h_ = h;
    connected_ = true;
    timed_out_.store(false);
  }
  RemoteCounters::add(counters_.reconnects);
  log::info("{}: connected to the server again", uri_);
  return true;
}

Status NbdFile::error(std::string_view what, uint64_t off, int err) const {
  return Status::errorf(err ? err : EIO, "{}: {} at {}: {}", uri_, what, off, std::strerror(err ? err : EIO));
}

template <typename Submit>
Task<Status> NbdFile::command(std::string_view what, uint64_t off, Submit submit) {
  Op op;
  co_return co_await command_with(what, off, op, std::move(submit));
}

template <typename Submit>
Task<Status> NbdFile::command_with(std::string_view what, uint64_t off, Op& op, Submit submit) {
  nbd_completion_callback cb{&Op::on_done, &op, nullptr};
  uint64_t id;
  int64_t cookie = -1;
  int err = 0;
  std::string why;
  bool lost = false;
  {
    // Under mu_ so the network thread cannot close the handle meanwhile.
    std::lock_guard lk(mu_);
    lost = !connected_;
    id = next_id_++;
    if (!lost) {
      in_flight_.emplace(id, std::chrono::steady_clock::now());
      RemoteCounters::add(counters_.requests);
      cookie = submit(h_, cb, op);
    }
    if (!lost && cookie < 0) {
      err = timed_out_.load() ? EIO : nbd_get_errno();
      why = nbd_get_error() ? nbd_get_error() : "";
      in_flight_.erase(id);
    }
  }
  if (lost) {
    RemoteCounters::add(counters_.errors);
    co_return Status::errorf(EIO, "{}: {} at {}: the connection to the server is lost (connecting again)", uri_,
                             what, off);
  }
  if (cookie < 0) {
    RemoteCounters::add(counters_.errors);
    co_return Status::errorf(err ? err : EIO, "{}: {} at {}: {}", uri_, what, off, why);
  }
  wake();
  co_await op.done.wait();
  {
    std::lock_guard lk(mu_);
    in_flight_.erase(id);
  }
  if (op.err) {
    RemoteCounters::add(counters_.errors);
    // A lost connection is EIO to the reader, as a failing disk is.
    const bool lost_now = timed_out_.load() || op.err == ENOTCONN || op.err == ESHUTDOWN || op.err == ECONNRESET ||
                          op.err == EPIPE;
    co_return error(what, off, lost_now ? EIO : op.err);
  }
  co_return Status::ok();
}

Task<Status> NbdFile::read_piece(uint64_t off, std::span<std::byte> buf) {
  RemoteCounters::add(counters_.in_flight_bytes, buf.size());
  Status st = co_await command("read", off, [&](nbd_handle* h, nbd_completion_callback cb, Op&) {
    return nbd_aio_pread(h, buf.data(), buf.size(), off, cb, 0);
  });
  RemoteCounters::sub(counters_.in_flight_bytes, buf.size());
  if (st) RemoteCounters::add(counters_.bytes_fetched, buf.size());
  co_return st;
}

Task<Result<size_t>> NbdFile::read(uint64_t off, std::span<std::byte> buf) {
  if (off >= size_) co_return size_t{0};
  const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), size_ - off));
  if (n < 2 * kNbdReadPiece) {  // one command (split_read's answer), without its allocations
    QCOWFS_CO_TRY(co_await read_piece(off, buf.first(n)));
    co_return n;
  }
  // All pieces at once: the server reads the next while it sends one.
  std::vector<Task<Status>> pieces;
  for (const ReadPiece& p : split_read(n, kNbdReadPiece, kNbdMaxRequest))
    pieces.push_back(read_piece(off + p.offset, buf.subspan(p.offset, p.length)));
  QCOWFS_CO_TRY(co_await when_all(std::move(pieces)));
  co_return n;
}

Task<Result<size_t>> NbdFile::readv(uint64_t off, std::span<const iovec> iov) {
  return read_iov(off, iov, [this](uint64_t at, std::span<std::byte> buf) { return read(at, buf); });
}

Task<Status> NbdFile::write(uint64_t off, std::span<const std::byte> buf) {
  if (!writable_) co_return Status::errorf(EROFS, "{} is open read-only", uri_);
  if (off > size_ || buf.size() > size_ - off)
    co_return Status::errorf(ENOSPC, "{}: a write at {} of {} bytes passes the export's end ({})", uri_, off,
                             buf.size(), size_);
  for (size_t done = 0; done < buf.size();) {
    const size_t chunk = static_cast<size_t>(std::min<uint64_t>(buf.size() - done, kNbdMaxRequest));
    const std::byte* src = buf.data() + done;
    const uint64_t at = off + done;
    QCOWFS_CO_TRY(co_await command("write", at, [&](nbd_handle* h, nbd_completion_callback cb, Op&) {
      return nbd_aio_pwrite(h, src, chunk, at, cb, 0);
    }));
    RemoteCounters::add(counters_.bytes_written, chunk);
    done += chunk;
  }
  co_return Status::ok();
}

Task<Status> NbdFile::writev(uint64_t off, std::span<const iovec> iov) {
  uint64_t at = off;
  for (const iovec& v : iov) {
    QCOWFS_CO_TRY(co_await write(at, std::span(static_cast<const std::byte*>(v.iov_base), v.iov_len)));
    at += v.iov_len;
  }
  co_return Status::ok();
}

Task<Status> NbdFile::flush() {
  if (!writable_ || !can_flush_) co_return Status::ok();
  co_return co_await command("flush", 0, [&](nbd_handle* h, nbd_completion_callback cb, Op&) { return nbd_aio_flush(h, cb, 0); });
}

Task<Status> NbdFile::discard(uint64_t off, uint64_t len) {
  if (!writable_) co_return Status::errorf(EROFS, "{} is open read-only", uri_);
  if (!can_trim_ || off >= size_) co_return Status::ok();  // a hint, as on a device
  len = std::min(len, size_ - off);
  for (uint64_t done = 0; done < len;) {
    const uint64_t chunk = std::min(len - done, kNbdMaxStatusSpan);
    const uint64_t at = off + done;
    QCOWFS_CO_TRY(co_await command("trim", at, [&](nbd_handle* h, nbd_completion_callback cb, Op&) {
      return nbd_aio_trim(h, chunk, at, cb, 0);
    }));
    done += chunk;
  }
  co_return Status::ok();
}

Task<Status> NbdFile::write_zeroes(uint64_t off, uint64_t len) {
  if (!writable_) co_return Status::errorf(EROFS, "{} is open read-only", uri_);
  if (off > size_ || len > size_ - off) co_return Status::errorf(ENOSPC, "{}: zeroing past the export's end", uri_);
  for (uint64_t done = 0; done < len;) {
    const uint64_t chunk = std::min(len - done, can_zero_ ? kNbdMaxStatusSpan : kNbdMaxRequest);
    const uint64_t at = off + done;
    if (can_zero_) {
      QCOWFS_CO_TRY(co_await command("write zeroes", at, [&](nbd_handle* h, nbd_completion_callback cb, Op&) {
        return nbd_aio_zero(h, chunk, at, cb, 0);
      }));
    } else {
      std::vector<std::byte> zeros(chunk);
      QCOWFS_CO_TRY(co_await write(at, zeros));
    }
    done += chunk;
  }
  co_return Status::ok();
}

Task<Status> NbdFile::truncate(uint64_t) {
  co_return Status::errorf(EINVAL, "{}: an NBD export cannot change its size", uri_);
}

Task<Result<uint64_t>> NbdFile::seek(uint64_t off, bool want_data) {
  if (off >= size_) co_return size_;
  if (!can_status_) co_return want_data ? off : size_;
  uint64_t pos = off;
  while (pos < size_) {
    const uint64_t count = std::min(size_ - pos, kNbdMaxStatusSpan);
    Op op;
    QCOWFS_CO_TRY(co_await command_with("block status", pos, op, [&](nbd_handle* h, nbd_completion_callback cb, Op& o) {
      nbd_extent_callback ecb{&Op::on_extents, &o, nullptr};
      return nbd_aio_block_status(h, count, pos, ecb, cb, 0);
    }));
    if (op.extents.empty()) break;  // the server said nothing: treat the rest as data
    for (const auto& [len, hole] : op.extents) {
      if (hole != want_data) co_return std::max(pos, off);
      pos += len;
      if (pos >= size_) break;
    }
  }
  if (pos < size_ && want_data) co_return pos;
  co_return size_;
}

Task<Result<uint64_t>> NbdFile::seek_data(uint64_t off) { co_return co_await seek(off, true); }
Task<Result<uint64_t>> NbdFile::seek_hole(uint64_t off) { co_return co_await seek(off, false); }

}  // namespace qcowfs::io
