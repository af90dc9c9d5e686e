#include "io/remote/nbd_file.h"

#include <libnbd.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "io/log.h"
#include "io/sync.h"

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

}  // namespace

NbdFile::NbdFile(std::string uri, nbd_handle* h, UniqueFd wake, uint64_t size, bool writable, unsigned timeout_ms)
    : uri_(std::move(uri)), h_(h), wake_(std::move(wake)), size_(size), writable_(writable), timeout_(timeout_ms) {
  can_flush_ = nbd_can_flush(h_) == 1;
  can_trim_ = nbd_can_trim(h_) == 1;
  can_zero_ = nbd_can_zero(h_) == 1;
  can_status_ = nbd_can_meta_context(h_, LIBNBD_CONTEXT_BASE_ALLOCATION) == 1;
  thread_ = std::thread([this] { run(); });
}

NbdFile::~NbdFile() {
  stopping_.store(true);
  wake();
  thread_.join();
  nbd_close(h_);
}

Result<std::unique_ptr<NbdFile>> NbdFile::open(const std::string& uri, const OpenOptions& opts) {
  auto ro = effective_remote_options(opts.remote);
  if (!ro) return ro.status();
  nbd_handle* h = nbd_create();
  if (!h) return Status::errorf(ENOMEM, "{}: {}", uri, nbd_get_error());
  auto fail = [&](int err, std::string_view what) {
    Status st = Status::errorf(err ? err : EIO, "{}: {}", uri, what);
    nbd_close(h);
    return st;
  };
  nbd_add_meta_context(h, LIBNBD_CONTEXT_BASE_ALLOCATION);
  if (nbd_connect_uri(h, uri.c_str()) < 0) return fail(nbd_get_errno(), nbd_get_error());
  const int64_t size = nbd_get_size(h);
  if (size < 0) return fail(nbd_get_errno(), nbd_get_error());
  if (opts.writable && nbd_is_read_only(h) == 1) return fail(EROFS, "the server exports it read-only");
  UniqueFd wake(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake.valid()) return fail(errno, "eventfd");
  log::info("{}: {} bytes over NBD, {}", uri, size, opts.writable ? "read-write" : "read-only");
  return std::unique_ptr<NbdFile>(
      new NbdFile(uri, h, std::move(wake), static_cast<uint64_t>(size), opts.writable, ro->timeout_ms));
}

void NbdFile::wake() {
  const uint64_t one = 1;
  [[maybe_unused]] auto n = ::write(wake_.get(), &one, sizeof one);
}

void NbdFile::run() {
  while (!stopping_.load()) {
    const int fd = nbd_aio_get_fd(h_);
    const unsigned dir = nbd_aio_get_direction(h_);
    pollfd p[2] = {{fd, 0, 0}, {wake_.get(), POLLIN, 0}};
    if (dir & LIBNBD_AIO_DIRECTION_READ) p[0].events |= POLLIN;
    if (dir & LIBNBD_AIO_DIRECTION_WRITE) p[0].events |= POLLOUT;
    if (::poll(p, 2, 1000) < 0) continue;
    if (fd >= 0 && (p[0].revents & (POLLIN | POLLHUP | POLLERR))) {
      nbd_aio_notify_read(h_);
    } else if (fd >= 0 && (p[0].revents & POLLOUT)) {
      nbd_aio_notify_write(h_);
    }
    if (p[1].revents & POLLIN) {
      uint64_t v;
      [[maybe_unused]] auto n = ::read(wake_.get(), &v, sizeof v);
    }
    check_deadlines();
  }
}

void NbdFile::check_deadlines() {
  std::chrono::steady_clock::time_point oldest;
  {
    std::lock_guard lk(mu_);
    if (in_flight_.empty() || timed_out_.load()) return;
    oldest = std::min_element(in_flight_.begin(), in_flight_.end(),
                              [](const auto& a, const auto& b) { return a.second < b.second; })->second;
  }
  if (std::chrono::steady_clock::now() - oldest < timeout_) return;
  log::error("{}: the server did not answer within {} s; dropping the connection (its reads and writes fail "
             "with EIO from now on)", uri_, timeout_.count() / 1000);
  timed_out_.store(true);
  // libnbd sees the end of the connection and fails every command in flight.
  const int fd = nbd_aio_get_fd(h_);
  if (fd >= 0) ::shutdown(fd, SHUT_RDWR);
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
  {
    std::lock_guard lk(mu_);
    id = next_id_++;
    in_flight_.emplace(id, std::chrono::steady_clock::now());
  }
  if (submit(cb, op) < 0) {
    const int err = timed_out_.load() ? EIO : nbd_get_errno();
    std::string why = nbd_get_error() ? nbd_get_error() : "";
    {
      std::lock_guard lk(mu_);
      in_flight_.erase(id);
    }
    co_return Status::errorf(err ? err : EIO, "{}: {} at {}: {}", uri_, what, off, why);
  }
  wake();
  co_await op.done.wait();
  {
    std::lock_guard lk(mu_);
    in_flight_.erase(id);
  }
  if (op.err) co_return error(what, off, timed_out_.load() ? EIO : op.err);
  co_return Status::ok();
}

Task<Result<size_t>> NbdFile::read(uint64_t off, std::span<std::byte> buf) {
  if (off >= size_) co_return size_t{0};
  const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), size_ - off));
  for (size_t done = 0; done < n;) {
    const size_t chunk = static_cast<size_t>(std::min<uint64_t>(n - done, kNbdMaxRequest));
    std::byte* dst = buf.data() + done;
    const uint64_t at = off + done;
    QCOWFS_CO_TRY(co_await command("read", at, [&](nbd_completion_callback cb, Op&) {
      return nbd_aio_pread(h_, dst, chunk, at, cb, 0);
    }));
    done += chunk;
  }
  co_return n;
}

Task<Result<size_t>> NbdFile::readv(uint64_t off, std::span<const iovec> iov) {
  size_t total = 0;
  for (const iovec& v : iov) {
    auto n = co_await read(off + total, std::span(static_cast<std::byte*>(v.iov_base), v.iov_len));
    if (!n) co_return n.status();
    total += *n;
    if (*n < v.iov_len) break;
  }
  co_return total;
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
    QCOWFS_CO_TRY(co_await command("write", at, [&](nbd_completion_callback cb, Op&) {
      return nbd_aio_pwrite(h_, src, chunk, at, cb, 0);
    }));
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
  co_return co_await command("flush", 0, [&](nbd_completion_callback cb, Op&) { return nbd_aio_flush(h_, cb, 0); });
}

Task<Status> NbdFile::discard(uint64_t off, uint64_t len) {
  if (!writable_) co_return Status::errorf(EROFS, "{} is open read-only", uri_);
  if (!can_trim_ || off >= size_) co_return Status::ok();  // a hint, as on a device
  len = std::min(len, size_ - off);
  for (uint64_t done = 0; done < len;) {
    const uint64_t chunk = std::min(len - done, kNbdMaxStatusSpan);
    const uint64_t at = off + done;
    QCOWFS_CO_TRY(co_await command("trim", at, [&](nbd_completion_callback cb, Op&) {
      return nbd_aio_trim(h_, chunk, at, cb, 0);
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
      QCOWFS_CO_TRY(co_await command("write zeroes", at, [&](nbd_completion_callback cb, Op&) {
        return nbd_aio_zero(h_, chunk, at, cb, 0);
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
    QCOWFS_CO_TRY(co_await command_with("block status", pos, op, [&](nbd_completion_callback cb, Op& o) {
      nbd_extent_callback ecb{&Op::on_extents, &o, nullptr};
      return nbd_aio_block_status(h_, count, pos, ecb, cb, 0);
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
