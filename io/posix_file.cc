#include "io/posix_file.h"

#include <fcntl.h>
#include <linux/falloc.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <optional>

#include "io/align.h"
#include "io/buffer.h"
#include "io/engine.h"
#include "io/iov.h"
#include "io/log.h"
#include "io/remote/http_file.h"

namespace qcowfs::io {
namespace {

constexpr size_t kMaxSegments = IOV_MAX;
// write_zeroes falls back to writing this many zero bytes per request.
constexpr size_t kZeroChunk = size_t{1} << 20;

const AlignedBuffer& zero_buffer() {
  static const AlignedBuffer buf(kZeroChunk, 64 * 1024);
  return buf;
}

size_t page_size() {
  long p = ::sysconf(_SC_PAGESIZE);
  return p > 0 ? static_cast<size_t>(p) : 4096;
}

bool is_unsupported(int64_t r) { return r == -EOPNOTSUPP || r == -ENOTTY; }

IoRequest transfer(IoRequest::Op one, IoRequest::Op many, int fd, std::span<const iovec> segs, uint64_t off) {
  IoRequest req;
  req.fd = fd;
  req.offset = off;
  if (segs.size() == 1) {
    req.op = one;
    req.buf = segs[0].iov_base;
    req.length = segs[0].iov_len;
  } else {
    req.op = many;
    req.iov = segs.data();
    req.iovcnt = static_cast<unsigned>(segs.size());
  }
  return req;
}

Result<UniqueFd> open_fd(const std::string& path, bool writable, CacheMode cache) {
  int flags = writable ? O_RDWR : O_RDONLY;
  if (cache == CacheMode::none) flags |= O_DIRECT;
  if (cache == CacheMode::writethrough) flags |= O_DSYNC;
  return open_regular_or_block(path, flags);
}

// cache=none is only ever asked for explicitly, so a host that refuses
// O_DIRECT is an error, never a silent fall back to the page cache.
Status direct_refused(const std::string& path) {
  return Status::errorf(EINVAL, "cache=none: {} does not support O_DIRECT (try cache=writeback)", path);
}

// Opens with the requested cache mode; O_DIRECT refused at open is EINVAL.
// EINVAL is also what refuses a FIFO or a directory, so an EINVAL under
// cache=none is O_DIRECT's only when the same open succeeds without it.
Result<UniqueFd> open_with_cache(const std::string& path, const OpenOptions& opts, CacheMode* cache) {
  *cache = opts.cache_mode();
  auto fd = open_fd(path, opts.writable, *cache);
  if (fd || fd.status().code() != EINVAL || *cache != CacheMode::none) return fd;
  auto plain = open_fd(path, opts.writable, CacheMode::writeback);
  if (!plain) return plain.status();
  return direct_refused(path);
}

Result<uint64_t> host_size(int fd, const struct stat& st, const std::string& path) {
  if (!S_ISBLK(st.st_mode)) return static_cast<uint64_t>(st.st_size);
  uint64_t size = 0;
  if (::ioctl(fd, BLKGETSIZE64, &size) < 0) return Status::from_errno(errno, fmt::format("BLKGETSIZE64 {}", path));
  return size;
}

size_t logical_block_size(int fd) {
  int lbs = 0;
  if (::ioctl(fd, BLKSSZGET, &lbs) < 0 || lbs <= 0) return 512;
  return static_cast<size_t>(lbs);
}

const char* file_type_name(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  return "of an unknown type";
}

std::string named(std::string_view what, const std::string& path) {
  return what.empty() ? path : fmt::format("{} {}", what, path);
}

// EINVAL unless fd (opened from path) is a regular file or a block device.
Status check_file_type(int fd, const std::string& path, std::string_view what) {
  struct stat st;
  if (::fstat(fd, &st) < 0) return Status::from_errno(errno, fmt::format("fstat {}", named(what, path)));
  if (S_ISREG(st.st_mode) || S_ISBLK(st.st_mode)) return Status::ok();
  return Status::errorf(EINVAL, "{} is {}, not a regular file or block device", named(what, path),
                        file_type_name(st.st_mode));
}

// statx(STATX_DIOALIGN) alone: has_value() when the kernel reports it; then
// nullopt inside when the file system says the file cannot do direct I/O.
std::optional<std::optional<DirectAlignment>> reported_direct_alignment(int fd) {
  struct statx sx {};
  if (::statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) != 0 || !(sx.stx_mask & STATX_DIOALIGN)) return std::nullopt;
  if (sx.stx_dio_offset_align == 0) return std::optional<DirectAlignment>();
  return DirectAlignment{std::max<size_t>(sx.stx_dio_mem_align, 1), sx.stx_dio_offset_align};
}

// PosixFile::direct_io_align(): from the detected alignment under cache=none,
// else from what statx reports (0 when it does not say).
size_t direct_io_align_of(int fd, CacheMode cache, const DirectAlignment& detected) {
  if (cache == CacheMode::none) return std::max(detected.mem, detected.offset);
  auto reported = reported_direct_alignment(fd);
  if (!reported || !*reported) return 0;
  return std::max((*reported)->mem, (*reported)->offset);
}

}  // namespace

Result<UniqueFd> open_regular_or_block(const std::string& path, int flags, std::string_view what) {
  // O_PATH neither blocks on a FIFO nor runs a device's open.
  UniqueFd probe(::open(path.c_str(), O_PATH | O_CLOEXEC));
  if (!probe.valid()) return Status::from_errno(errno, fmt::format("opening {}", named(what, path)));
  QCOWFS_TRY(check_file_type(probe.get(), path, what));
  UniqueFd fd(::open(path.c_str(), flags | O_NONBLOCK | O_NOCTTY | O_CLOEXEC));
  if (!fd.valid()) {
    const int err = errno;
    if (err == EWOULDBLOCK)
      return Status::errorf(err, "opening {}: another process holds a lease on it", named(what, path));
    return Status::from_errno(err, fmt::format("opening {}", named(what, path)));
  }
  QCOWFS_TRY(check_file_type(fd.get(), path, what));
  const int fl = ::fcntl(fd.get(), F_GETFL);
  if (fl < 0 || ::fcntl(fd.get(), F_SETFL, fl & ~O_NONBLOCK) < 0)
    return Status::from_errno(errno, fmt::format("clearing O_NONBLOCK on {}", named(what, path)));
  return fd;
}

std::optional<DirectAlignment> detect_direct_alignment(int fd, bool block_device, uint64_t size) {
  if (auto reported = reported_direct_alignment(fd)) return *reported;
  if (block_device) {
    size_t lbs = logical_block_size(fd);
    return DirectAlignment{lbs, lbs};
  }
  return probe_direct_alignment(fd, size);
}

DirectAlignment probe_direct_alignment(int fd, uint64_t size) {
  // A read at or past EOF succeeds whatever its alignment, so small files tell nothing.
  if (size >= 4096) {
    AlignedBuffer probe(4096, 4096, false);
    for (size_t a = 512; a <= 4096; a *= 2) {
      if (::pread(fd, probe.data(), a, 0) >= 0) return DirectAlignment{a, a};
    }
  }
  return DirectAlignment{4096, 4096};
}

Result<std::unique_ptr<HostFile>> open_host_file(const std::string& path, const OpenOptions& opts) {
  if (is_remote_location(path)) return open_remote_file(path, opts);
  auto f = PosixFile::open(path, opts);
  if (!f) return f.status();
  auto lock = ImageLock::acquire(path, LockPerms::for_image(opts.writable, opts.force_share), opts.locking);
  if (!lock) return lock.status();
  (*f)->hold_lock(std::move(*lock));
  return std::unique_ptr<HostFile>(std::move(*f));
}

Result<std::unique_ptr<HostFile>> create_host_file(const std::string& path, OpenOptions opts) {
  if (is_remote_location(path)) return Status::errorf(EINVAL, "{}: images are created on local files only", path);
  // An existing FIFO, socket, directory or character device is refused before
  // O_CREAT | O_TRUNC opens it (O_PATH neither blocks nor runs a device's open).
  if (UniqueFd probe(::open(path.c_str(), O_PATH | O_CLOEXEC)); probe.valid())
    QCOWFS_TRY(check_file_type(probe.get(), path, {}));
  UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | O_NONBLOCK | O_NOCTTY, 0644));
  if (fd.get() < 0) return Status::from_errno(errno, fmt::format("creating {}", path));
  opts.writable = true;
  return open_host_file(path, opts);
}

Result<std::unique_ptr<PosixFile>> PosixFile::open(const std::string& path, const OpenOptions& opts) {
  CacheMode cache;
  auto fd = open_with_cache(path, opts, &cache);
  if (!fd) return fd.status();
  struct stat st;
  if (::fstat(fd->get(), &st) < 0) return Status::from_errno(errno, fmt::format("fstat {}", path));
  bool blk = S_ISBLK(st.st_mode);
  auto size = host_size(fd->get(), st, path);
  if (!size) return size.status();
  DirectAlignment align;
  if (cache == CacheMode::none) {
    auto detected = detect_direct_alignment(fd->get(), blk, *size);
    if (!detected) return direct_refused(path);
    align = *detected;
  }
  const size_t logical_block = blk ? logical_block_size(fd->get()) : 1;
  const size_t dio_align = direct_io_align_of(fd->get(), cache, align);
  Params p{std::move(*fd), path, cache, opts.writable, blk, *size, logical_block, align, dio_align};
  log::debug("opened {} ({}, cache={}, {} bytes, O_DIRECT alignment: offset {}, memory {})", path,
             blk ? "block device" : "file", to_string(cache), *size, align.offset, align.mem);
  return std::unique_ptr<PosixFile>(new PosixFile(std::move(p)));
}

Result<std::unique_ptr<PosixFile>> PosixFile::adopt(UniqueFd fd, std::string name, CacheMode cache) {
  if (cache == CacheMode::none || cache == CacheMode::writethrough)
    return Status::errorf(EINVAL, "{}: an adopted file is opened with cache=writeback or unsafe", name);
  struct stat st;
  if (::fstat(fd.get(), &st) < 0) return Status::from_errno(errno, fmt::format("fstat {}", name));
  if (!S_ISREG(st.st_mode)) return Status::errorf(EINVAL, "{} is not a regular file", name);
  const size_t dio_align = direct_io_align_of(fd.get(), cache, DirectAlignment{});
  Params p{std::move(fd), std::move(name), cache, true, false, static_cast<uint64_t>(st.st_size), 1,
           DirectAlignment{}, dio_align};
  return std::unique_ptr<PosixFile>(new PosixFile(std::move(p)));
}

Result<std::unique_ptr<HostFile>> create_unnamed_file(const std::string& dir) {
  UniqueFd fd(::open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600));
  if (!fd.valid() && (errno == EOPNOTSUPP || errno == EISDIR)) {
    // No O_TMPFILE on this file system: a named file, unlinked at once.
    std::string name = dir + "/qcowfs-XXXXXX";
    fd.reset(::mkostemp(name.data(), O_CLOEXEC));
    if (fd.valid() && ::unlink(name.c_str()) != 0)
      return Status::from_errno(errno, fmt::format("removing the temporary file {}", name));
  }
  if (!fd.valid()) return Status::from_errno(errno, fmt::format("creating a temporary file in {}", dir));
  auto f = PosixFile::adopt(std::move(fd), fmt::format("{}/(temporary file)", dir), CacheMode::unsafe);
  if (!f) return f.status();
  return std::unique_ptr<HostFile>(std::move(*f));
}

PosixFile::PosixFile(Params p)
    : fd_(std::move(p.fd)),
      path_(std::move(p.path)),
      cache_(p.cache),
      writable_(p.writable),
      block_device_(p.block_device),
      logical_block_(p.logical_block),
      dio_mem_align_(p.align.mem),
      mem_align_(std::max({size_t{4096}, page_size(), p.align.mem})),
      offset_align_(p.align.offset),
      direct_io_align_(p.direct_io_align),
      size_(p.size) {}

uint64_t PosixFile::allocated_bytes() const {
  if (block_device_) return size();
  struct stat st;
  if (::fstat(fd_.get(), &st) < 0) return 0;
  return static_cast<uint64_t>(st.st_blocks) * 512;
}

std::optional<FileIdentity> file_identity(const HostFile& file) {
  struct stat st;
  if (file.kernel_fd() < 0 || ::fstat(file.kernel_fd(), &st) < 0) return std::nullopt;
  return FileIdentity{static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)};
}

Status PosixFile::check_engine() const {
  if (!Engine::current()) return Status::errorf(EINVAL, "{}: no engine on this thread", path_);
  return Status::ok();
}

Status PosixFile::check_writable() const {
  if (!writable_) return Status::errorf(EROFS, "{} is open read-only", path_);
  return Status::ok();
}

void PosixFile::grow_size(uint64_t end) {
  uint64_t cur = size_.load(std::memory_order_relaxed);
  while (cur < end && !size_.compare_exchange_weak(cur, end, std::memory_order_acq_rel)) {
  }
}

bool PosixFile::host_can_take(std::span<const iovec> iov, uint64_t off, uint64_t len) const {
  if (!direct()) return true;
  if (!is_aligned(off, offset_align_) || !is_aligned(len, offset_align_)) return false;
  for (const iovec& v : iov) {
    if (!is_aligned_ptr(v.iov_base, dio_mem_align_) || !is_aligned(v.iov_len, offset_align_)) return false;
  }
  return true;
}

// ---- reads ----

Task<Result<size_t>> PosixFile::read(uint64_t off, std::span<std::byte> buf) {
  iovec one{buf.data(), buf.size()};
  co_return co_await read_iov({&one, 1}, off);
}

// iov belongs to the caller: not a coroutine, so a request's read is two
// coroutine frames (read(), read_loop()), not three.
Task<Result<size_t>> PosixFile::readv(uint64_t off, std::span<const iovec> iov) { return read_iov(iov, off); }

// Not a coroutine (see readv()): the task that reads iov, which must outlive it.
Task<Result<size_t>> PosixFile::read_iov(std::span<const iovec> iov, uint64_t off) {
  const uint64_t len = iov_total(iov);
  if (len == 0 || host_can_take(iov, off, len)) return read_loop(iov, off);
  return bounce_read(iov, off, len);
}

// Reads straight into iov, continuing short reads, until done or EOF. On an
// O_DIRECT file a short read ending inside a host block is EOF.
Task<Result<size_t>> PosixFile::read_loop(std::span<const iovec> iov, uint64_t off) {
  QCOWFS_CO_TRY(check_engine());  // here, not in read_iov(): see write_loop()
  const size_t total = iov_total(iov);
  IovCursor cursor(iov);
  size_t done = 0;
  while (done < total) {
    auto segs = cursor.segments(kMaxSegments);
    int64_t r = co_await io::async(transfer(IoRequest::Op::read, IoRequest::Op::readv, fd_.get(), segs, off + done));
    if (r < 0) co_return Status::from_errno(static_cast<int>(-r), fmt::format("reading {} at offset {}", path_, off + done));
    if (r == 0) break;
    done += static_cast<size_t>(r);
    if (done == total || (direct() && !is_aligned(off + done, offset_align_))) break;
    cursor.advance(static_cast<size_t>(r));
  }
  co_return done;
}

// Reads the covering aligned range into a bounce buffer and copies out the
// requested part (fewer bytes at EOF).
Task<Result<size_t>> PosixFile::bounce_read(std::span<const iovec> iov, uint64_t off, uint64_t len) {
  const uint64_t start = align_down(off, offset_align_);
  const uint64_t end = align_up(off + len, offset_align_);
  AlignedBuffer bounce(end - start, mem_align_, false);
  iovec one{bounce.data(), bounce.size()};
  auto n = co_await read_loop({&one, 1}, start);
  if (!n) co_return n.status();
  const size_t skip = off - start;
  const size_t avail = *n > skip ? std::min<size_t>(len, *n - skip) : 0;
  copy_to_iov(iov, bounce.data() + skip, avail);
  co_return avail;
}

// ---- writes ----

Task<Status> PosixFile::write(uint64_t off, std::span<const std::byte> buf) {
  iovec one{const_cast<std::byte*>(buf.data()), buf.size()};
  co_return co_await write_iov({&one, 1}, off);
}

// As readv(): not a coroutine.
Task<Status> PosixFile::writev(uint64_t off, std::span<const iovec> iov) { return write_iov(iov, off); }

namespace {
Task<Status> failed(Status st) { co_return st; }
}  // namespace

// Not a coroutine (see readv()): the task that writes iov, which must outlive it.
Task<Status> PosixFile::write_iov(std::span<const iovec> iov, uint64_t off) {
  if (Status st = check_writable(); !st) return failed(std::move(st));
  const uint64_t len = iov_total(iov);
  if (off + len < off) return failed(Status::errorf(EINVAL, "{}: write at {} overflows", path_, off));
  if (len > 0 && !host_can_take(iov, off, len)) return bounce_write(iov, off, len);
  return write_loop(iov, off, true);
}

// Writes all of iov, continuing short writes. With `lock` (a write the host
// takes as it is), the range is locked shared first on an O_DIRECT file and
// the file's size grown after; bounce_write() holds its own lock.
Task<Status> PosixFile::write_loop(std::span<const iovec> iov, uint64_t off, bool lock) {
  QCOWFS_CO_TRY(check_engine());  // here, not in write_iov(): a task may be made before its thread runs it
  const size_t total = iov_total(iov);
  if (total == 0) co_return Status::ok();
  RangeLock::Guard guard;
  if (lock && direct()) guard = co_await locks_.lock(off, off + total, RangeLock::Mode::shared);
  IovCursor cursor(iov);
  size_t done = 0;
  while (done < total) {
    auto segs = cursor.segments(kMaxSegments);
    int64_t r =
        co_await io::async(transfer(IoRequest::Op::write, IoRequest::Op::writev, fd_.get(), segs, off + done));
    if (r < 0) co_return Status::from_errno(static_cast<int>(-r), fmt::format("writing {} at offset {}", path_, off + done));
    if (r == 0) co_return Status::errorf(EIO, "writing {} at offset {}: no progress", path_, off + done);
    done += static_cast<size_t>(r);
    if (done == total) break;
    if (direct() && !is_aligned(off + done, offset_align_))
      co_return Status::errorf(EIO, "writing {} at offset {}: short direct write ended mid-block", path_, off + done);
    cursor.advance(static_cast<size_t>(r));
  }
  if (lock) grow_size(off + total);
  co_return Status::ok();
}

// Copies iov into an aligned bounce buffer covering whole host blocks, first
// reading the partial head and tail blocks (read-modify-write), and writes the
// blocks. The blocks are locked exclusively for the whole cycle. When the last
// block reaches past EOF the file must be cut back to the real end afterwards,
// so the lock then extends to infinity: no other write beyond can be in flight
// while the file is briefly too long.
Task<Status> PosixFile::bounce_write(std::span<const iovec> iov, uint64_t off, uint64_t len) {
  QCOWFS_CO_TRY(check_engine());
  const uint64_t a = offset_align_;
  const uint64_t end = off + len;
  const uint64_t start = align_down(off, a);
  const uint64_t block_end = align_up(end, a);
  const bool head_partial = !is_aligned(off, a);
  const bool tail_partial = !is_aligned(end, a);
  const bool rmw = head_partial || tail_partial;
  const auto mode = rmw ? RangeLock::Mode::exclusive : RangeLock::Mode::shared;
  bool past_eof = rmw && !block_device_ && block_end > size();
  RangeLock::Guard guard = co_await locks_.lock(start, past_eof ? UINT64_MAX : block_end, mode);
  if (rmw && !block_device_ && !past_eof && block_end > size()) {  // a truncate got in first
    guard.release();
    past_eof = true;
    guard = co_await locks_.lock(start, UINT64_MAX, mode);
  }
  AlignedBuffer bounce(block_end - start, mem_align_, false);
  if (head_partial) QCOWFS_CO_TRY(co_await read_block(bounce.data(), start));
  const uint64_t last_block = block_end - a;
  if (tail_partial && !(head_partial && last_block == start))
    QCOWFS_CO_TRY(co_await read_block(bounce.data() + (last_block - start), last_block));
  copy_from_iov(bounce.data() + (off - start), iov, len);
  iovec one{bounce.data(), bounce.size()};
  QCOWFS_CO_TRY(co_await write_loop({&one, 1}, start, false));
  if (past_eof) QCOWFS_CO_TRY(co_await cut_back_to(end));
  grow_size(end);
  co_return Status::ok();
}

// Reads one host block into dst; bytes past EOF read as zeros.
Task<Status> PosixFile::read_block(std::byte* dst, uint64_t block_off) {
  iovec one{dst, offset_align_};
  auto n = co_await read_loop({&one, 1}, block_off);
  if (!n) co_return n.status();
  std::memset(dst + *n, 0, offset_align_ - *n);
  co_return Status::ok();
}

// After a bounce write whose last block went past EOF: the file now ends at a
// block boundary; cut it back to the larger of the old size and end.
Task<Status> PosixFile::cut_back_to(uint64_t end) {
  const uint64_t target = std::max(size(), end);
  if (is_aligned(target, offset_align_)) co_return Status::ok();
  const int fd = fd_.get();
  int64_t r = co_await io::offload([fd, target] {
    return ::ftruncate(fd, static_cast<off_t>(target)) < 0 ? int64_t{-errno} : int64_t{0};
  });
  if (r < 0) co_return Status::from_errno(static_cast<int>(-r), fmt::format("truncating {} to {}", path_, target));
  co_return Status::ok();
}

// ---- flush, discard, zeroes, truncate ----

Task<Status> PosixFile::flush() {
  QCOWFS_CO_TRY(check_engine());
  if (cache_ == CacheMode::unsafe) co_return Status::ok();
  IoRequest req;
  req.op = IoRequest::Op::fdatasync;
  req.fd = fd_.get();
  int64_t r = co_await io::async(std::move(req));
  if (r < 0) co_return Status::from_errno(static_cast<int>(-r), fmt::format("flushing {}", path_));
  co_return Status::ok();
}

Task<RangeLock::Guard> PosixFile::lock_exclusive(uint64_t off, uint64_t end) {
  if (!direct()) co_return RangeLock::Guard();
  uint64_t lock_end = end == UINT64_MAX ? end : align_up(end, offset_align_);
  co_return co_await locks_.lock(align_down(off, offset_align_), lock_end, RangeLock::Mode::exclusive);
}

// A hint: hosts that cannot deallocate (EOPNOTSUPP) report success.
Task<Status> PosixFile::discard(uint64_t off, uint64_t len) {
  QCOWFS_CO_TRY(check_engine());
  QCOWFS_CO_TRY(check_writable());
  if (len == 0) co_return Status::ok();
  int64_t r = 0;
  if (block_device_) {
    // BLKDISCARD takes whole logical blocks: keep the aligned part of the range.
    const uint64_t s = align_up(off, logical_block_);
    const uint64_t e = align_down(off + len, logical_block_);
    if (s >= e) co_return Status::ok();
    const int fd = fd_.get();
    r = co_await io::offload([fd, s, e] {
      uint64_t range[2] = {s, e - s};
      return ::ioctl(fd, BLKDISCARD, range) < 0 ? int64_t{-errno} : int64_t{0};
    });
  } else {
    RangeLock::Guard guard = co_await lock_exclusive(off, off + len);
    IoRequest req;
    req.op = IoRequest::Op::fallocate;
    req.fd = fd_.get();
    req.mode = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE;
    req.offset = off;
    req.length = len;
    r = co_await io::async(std::move(req));
  }
  if (is_unsupported(r)) co_return Status::ok();
  if (r < 0) co_return Status::from_errno(static_cast<int>(-r), fmt::format("discarding {} at {}+{}", path_, off, len));
  co_return Status::ok();
}

Task<Status> PosixFile::write_zeroes(uint64_t off, uint64_t len) {
  QCOWFS_CO_TRY(check_engine());
  QCOWFS_CO_TRY(check_writable());
  if (len == 0) co_return Status::ok();
  if (off + len < off) co_return Status::errorf(EINVAL, "{}: write_zeroes at {} overflows", path_, off);
  if (block_device_) co_return co_await device_zeroout(off, len);
  int64_t r;
  {
    RangeLock::Guard guard = co_await lock_exclusive(off, off + len);
    IoRequest req;
    req.op = IoRequest::Op::fallocate;
    req.fd = fd_.get();
    req.mode = FALLOC_FL_ZERO_RANGE;  // no KEEP_SIZE: zeroing past EOF extends like a write
    req.offset = off;
    req.length = len;
    r = co_await io::async(std::move(req));
  }
  if (r == 0) {
    grow_size(off + len);
    co_return Status::ok();
  }
  if (!is_unsupported(r))
    co_return Status::from_errno(static_cast<int>(-r), fmt::format("zeroing {} at {}+{}", path_, off, len));
  co_return co_await write_zero_chunks(off, len);
}

// BLKZEROOUT on the whole logical blocks inside the range, plain zero writes
// for the partial blocks at either end (or everywhere if BLKZEROOUT is refused).
Task<Status> PosixFile::device_zeroout(uint64_t off, uint64_t len) {
  const uint64_t end = off + len;
  const uint64_t s = align_up(off, logical_block_);
  const uint64_t e = align_down(end, logical_block_);
  if (s >= e) co_return co_await write_zero_chunks(off, len);
  const int fd = fd_.get();
  int64_t r = co_await io::offload([fd, s, e] {
    uint64_t range[2] = {s, e - s};
    return ::ioctl(fd, BLKZEROOUT, range) < 0 ? int64_t{-errno} : int64_t{0};
  });
  if (is_unsupported(r)) co_return co_await write_zero_chunks(off, len);
  if (r < 0) co_return Status::from_errno(static_cast<int>(-r), fmt::format("BLKZEROOUT {} at {}+{}", path_, s, e - s));
  if (off < s) QCOWFS_CO_TRY(co_await write_zero_chunks(off, s - off));
  if (e < end) QCOWFS_CO_TRY(co_await write_zero_chunks(e, end - e));
  co_return Status::ok();
}

Task<Status> PosixFile::write_zero_chunks(uint64_t off, uint64_t len) {
  const AlignedBuffer& zeros = zero_buffer();
  while (len > 0) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(len, zeros.size()));
    iovec one{const_cast<std::byte*>(zeros.data()), n};
    QCOWFS_CO_TRY(co_await write_iov({&one, 1}, off));
    off += n;
    len -= n;
  }
  co_return Status::ok();
}

Task<Status> PosixFile::truncate(uint64_t new_size) {
  QCOWFS_CO_TRY(check_engine());
  QCOWFS_CO_TRY(check_writable());
  if (block_device_) co_return Status::errorf(EINVAL, "{} is a block device: its size is fixed", path_);
  RangeLock::Guard guard = co_await lock_exclusive(std::min(new_size, size()), UINT64_MAX);
  const int fd = fd_.get();
  int64_t r = co_await io::offload([fd, new_size] {
    return ::ftruncate(fd, static_cast<off_t>(new_size)) < 0 ? int64_t{-errno} : int64_t{0};
  });
  if (r < 0) co_return Status::from_errno(static_cast<int>(-r), fmt::format("truncating {} to {}", path_, new_size));
  size_.store(new_size, std::memory_order_release);
  co_return Status::ok();
}

// ---- holes ----

Task<Result<uint64_t>> PosixFile::seek(uint64_t off, int whence) {
  QCOWFS_CO_TRY(check_engine());
  const uint64_t end = size();
  if (off >= end) co_return end;
  const int fd = fd_.get();
  int64_t r = co_await io::offload([fd, off, whence] {
    off_t pos = ::lseek(fd, static_cast<off_t>(off), whence);
    return pos < 0 ? int64_t{-errno} : int64_t{pos};
  });
  if (r == -ENXIO) co_return end;
  if (r == -EINVAL || is_unsupported(r)) co_return whence == SEEK_DATA ? off : end;  // cannot tell: all data
  if (r < 0) co_return Status::from_errno(static_cast<int>(-r), fmt::format("lseek {} at {}", path_, off));
  co_return std::min(static_cast<uint64_t>(r), end);
}

Task<Result<uint64_t>> PosixFile::seek_data(uint64_t off) { co_return co_await seek(off, SEEK_DATA); }
Task<Result<uint64_t>> PosixFile::seek_hole(uint64_t off) { co_return co_await seek(off, SEEK_HOLE); }

}  // namespace qcowfs::io
