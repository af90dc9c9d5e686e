#include "io/mem_file.h"

#include <algorithm>
#include <cstring>
#include <random>

#include "io/align.h"
#include "io/iov.h"

namespace qcowfs::io {
namespace {

constexpr uint64_t kPage = 4096;

uint64_t MemFileCounters::* counter_of(OpKind kind) {
  switch (kind) {
    case OpKind::read: return &MemFileCounters::reads;
    case OpKind::write: return &MemFileCounters::writes;
    case OpKind::flush: return &MemFileCounters::flushes;
    case OpKind::discard: return &MemFileCounters::discards;
    case OpKind::write_zeroes: return &MemFileCounters::write_zeroes;
    case OpKind::truncate: return &MemFileCounters::truncates;
    case OpKind::seek: return &MemFileCounters::seeks;
    case OpKind::any: break;
  }
  return nullptr;
}

}  // namespace

MemFile::MemFile(MemFileOptions opts, std::vector<std::byte> content)
    : opts_(std::move(opts)), mem_align_(std::max<size_t>(opts_.mem_align, 4096)) {
  set_content(std::move(content));
}

// ---- coroutine interface: every operation completes at once ----

Task<Result<size_t>> MemFile::read(uint64_t off, std::span<std::byte> buf) {
  iovec one{buf.data(), buf.size()};
  co_return read_now({&one, 1}, off);
}

Task<Result<size_t>> MemFile::readv(uint64_t off, std::span<const iovec> iov) { co_return read_now(iov, off); }

Task<Status> MemFile::write(uint64_t off, std::span<const std::byte> buf) {
  iovec one{const_cast<std::byte*>(buf.data()), buf.size()};
  co_return write_now({&one, 1}, off);
}

Task<Status> MemFile::writev(uint64_t off, std::span<const iovec> iov) { co_return write_now(iov, off); }

Task<Status> MemFile::flush() {
  std::lock_guard lk(mu_);
  QCOWFS_CO_TRY(begin_op(OpKind::flush, "flushing", 0));
  if (opts_.track_unflushed) {
    durable_ = data_;
    unflushed_.clear();
  }
  co_return Status::ok();
}

Task<Status> MemFile::discard(uint64_t off, uint64_t len) {
  std::lock_guard lk(mu_);
  QCOWFS_CO_TRY(begin_op(OpKind::discard, "discarding", off));
  if (!opts_.writable) co_return Status::errorf(EROFS, "{} is open read-only", opts_.path);
  const uint64_t end = std::min<uint64_t>(data_.size(), off + len < off ? UINT64_MAX : off + len);
  if (off >= end) co_return Status::ok();
  zero_range(off, end - off, true);
  record(Change{Change::Kind::zero, off, end - off, {}});
  co_return Status::ok();
}

Task<Status> MemFile::write_zeroes(uint64_t off, uint64_t len) {
  std::lock_guard lk(mu_);
  QCOWFS_CO_TRY(begin_op(OpKind::write_zeroes, "zeroing", off));
  if (!opts_.writable) co_return Status::errorf(EROFS, "{} is open read-only", opts_.path);
  if (off + len < off) co_return Status::errorf(EINVAL, "{}: write_zeroes at {} overflows", opts_.path, off);
  QCOWFS_CO_TRY(check_growth(off + len, "zeroing"));
  zero_range(off, len, false);
  record(Change{Change::Kind::zero, off, len, {}});
  co_return Status::ok();
}

Task<Status> MemFile::truncate(uint64_t new_size) {
  std::lock_guard lk(mu_);
  QCOWFS_CO_TRY(begin_op(OpKind::truncate, "truncating", new_size));
  if (!opts_.writable) co_return Status::errorf(EROFS, "{} is open read-only", opts_.path);
  if (opts_.block_device) co_return Status::errorf(EINVAL, "{} is a block device: its size is fixed", opts_.path);
  QCOWFS_CO_TRY(check_growth(new_size, "truncating"));
  resize(new_size);
  record(Change{Change::Kind::resize, new_size, 0, {}});
  co_return Status::ok();
}

Task<Result<uint64_t>> MemFile::seek_data(uint64_t off) { co_return seek_page(off, true); }

Task<Result<uint64_t>> MemFile::seek_hole(uint64_t off) { co_return seek_page(off, false); }

Result<uint64_t> MemFile::seek_page(uint64_t off, bool allocated) {
  std::lock_guard lk(mu_);
  QCOWFS_TRY(begin_op(OpKind::seek, allocated ? "seeking data in" : "seeking a hole in", off));
  const uint64_t size = data_.size();
  if (off >= size) return size;
  for (uint64_t p = off / kPage; p < allocated_.size(); ++p)
    if (allocated_[p] == allocated) return std::max(off, p * kPage);
  return size;
}

// ---- synchronous core ----

Result<size_t> MemFile::read_now(std::span<const iovec> iov, uint64_t off) {
  std::lock_guard lk(mu_);
  QCOWFS_TRY(begin_op(OpKind::read, "reading", off));
  const uint64_t len = iov_total(iov);
  if (is_unaligned(iov, off, len)) {
    ++counters_.unaligned;
    if (opts_.reject_unaligned)
      return Status::errorf(EINVAL, "reading {} at {}+{}: breaks the host alignment", opts_.path, off, len);
  }
  size_t avail = off < data_.size() ? static_cast<size_t>(std::min<uint64_t>(len, data_.size() - off)) : 0;
  for (auto it = shorts_.begin(); it != shorts_.end(); ++it) {
    if (it->kind != OpKind::read && it->kind != OpKind::any) continue;
    avail = std::min(avail, it->bytes);
    shorts_.erase(it);
    break;
  }
  if (avail) copy_to_iov(iov, data_.data() + off, avail);
  counters_.bytes_read += avail;
  return avail;
}

Status MemFile::write_now(std::span<const iovec> iov, uint64_t off) {
  std::lock_guard lk(mu_);
  QCOWFS_TRY(begin_op(OpKind::write, "writing", off));
  if (!opts_.writable) return Status::errorf(EROFS, "{} is open read-only", opts_.path);
  const uint64_t len = iov_total(iov);
  if (off + len < off) return Status::errorf(EINVAL, "{}: write at {} overflows", opts_.path, off);
  if (is_unaligned(iov, off, len)) {
    ++counters_.unaligned;
    if (opts_.reject_unaligned)
      return Status::errorf(EINVAL, "writing {} at {}+{}: breaks the host alignment", opts_.path, off, len);
  }
  QCOWFS_TRY(check_growth(off + len, "writing"));
  std::vector<std::byte> bytes(len);
  copy_from_iov(bytes.data(), iov, len);
  for (auto it = shorts_.begin(); it != shorts_.end(); ++it) {
    if (it->kind != OpKind::write && it->kind != OpKind::any) continue;
    const size_t stored = std::min<size_t>(it->bytes, len);
    const int err = it->err;
    shorts_.erase(it);
    bytes.resize(stored);
    store(off, bytes.data(), stored);
    record(Change{Change::Kind::write, off, stored, std::move(bytes)});
    return Status::from_errno(err, fmt::format("writing {} at offset {} (torn after {} bytes, injected)",
                                               opts_.path, off, stored));
  }
  store(off, bytes.data(), len);
  record(Change{Change::Kind::write, off, len, std::move(bytes)});
  return Status::ok();
}

Status MemFile::begin_op(OpKind kind, const char* what, uint64_t off) {
  ++(counters_.*counter_of(kind));
  int fired = 0;
  for (size_t i = 0; i < faults_.size();) {
    Fault& f = faults_[i];
    if (f.kind != OpKind::any && f.kind != kind) {
      ++i;
      continue;
    }
    if (f.countdown > 1) {
      --f.countdown;
      ++i;
      continue;
    }
    if (!fired) fired = f.err;
    if (f.sticky) {
      ++i;
    } else {
      faults_.erase(faults_.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }
  if (!fired) return Status::ok();
  return Status::from_errno(fired, fmt::format("{} {} at offset {} (injected)", what, opts_.path, off));
}

bool MemFile::is_unaligned(std::span<const iovec> iov, uint64_t off, uint64_t len) const {
  const size_t a = opts_.offset_align;
  if (!is_aligned(off, a) || !is_aligned(len, a)) return true;
  for (const iovec& v : iov)
    if (!is_aligned_ptr(v.iov_base, mem_align_) || !is_aligned(v.iov_len, a)) return true;
  return false;
}

Status MemFile::check_growth(uint64_t new_end, const char* what) const {
  if (new_end <= data_.size() || new_end <= size_limit_) return Status::ok();
  return Status::from_errno(ENOSPC, fmt::format("{} {} up to {} (limit {})", what, opts_.path, new_end, size_limit_));
}

void MemFile::store(uint64_t off, const std::byte* src, size_t len) {
  if (len == 0) return;
  if (off + len > data_.size()) resize(off + len);
  std::memcpy(data_.data() + off, src, len);
  for (uint64_t p = off / kPage; p <= (off + len - 1) / kPage; ++p) allocated_[p] = true;
  counters_.bytes_written += len;
}

void MemFile::zero_range(uint64_t off, uint64_t len, bool deallocate) {
  if (len == 0) return;
  if (off + len > data_.size()) resize(off + len);
  std::memset(data_.data() + off, 0, len);
  const uint64_t end = off + len;
  if (!deallocate) {
    for (uint64_t p = off / kPage; p < div_round_up(end, kPage); ++p) allocated_[p] = true;
    return;
  }
  // Only whole pages become holes; the last page is whole when the range reaches EOF.
  const uint64_t last = end == data_.size() ? div_round_up(end, kPage) : end / kPage;
  for (uint64_t p = div_round_up(off, kPage); p < last; ++p) allocated_[p] = false;
}

void MemFile::resize(uint64_t new_size) {
  data_.resize(new_size, std::byte{0});
  allocated_.resize(div_round_up(new_size, kPage), false);
}

void MemFile::record(Change c) {
  if (opts_.track_unflushed) unflushed_.push_back(std::move(c));
}

// ---- faults and inspection ----

void MemFile::fail_nth(OpKind kind, uint64_t nth, int err) {
  std::lock_guard lk(mu_);
  faults_.push_back(Fault{kind, std::max<uint64_t>(nth, 1), err, false});
}

void MemFile::fail_from(OpKind kind, uint64_t nth, int err) {
  std::lock_guard lk(mu_);
  faults_.push_back(Fault{kind, std::max<uint64_t>(nth, 1), err, true});
}

void MemFile::short_once(OpKind kind, size_t bytes, int err) {
  std::lock_guard lk(mu_);
  shorts_.push_back(ShortIo{kind, bytes, err});
}

void MemFile::set_size_limit(uint64_t limit) {
  std::lock_guard lk(mu_);
  size_limit_ = limit;
}

void MemFile::clear_faults() {
  std::lock_guard lk(mu_);
  faults_.clear();
  shorts_.clear();
  size_limit_ = UINT64_MAX;
}

uint64_t MemFile::size() const {
  std::lock_guard lk(mu_);
  return data_.size();
}

uint64_t MemFile::allocated_bytes() const {
  std::lock_guard lk(mu_);
  return static_cast<uint64_t>(std::count(allocated_.begin(), allocated_.end(), true)) * kPage;
}

MemFileCounters MemFile::counters() const {
  std::lock_guard lk(mu_);
  return counters_;
}

std::vector<std::byte> MemFile::content() const {
  std::lock_guard lk(mu_);
  return data_;
}

void MemFile::set_content(std::vector<std::byte> content) {
  std::lock_guard lk(mu_);
  data_ = std::move(content);
  allocated_.assign(div_round_up(data_.size(), kPage), true);
  durable_ = data_;
  unflushed_.clear();
}

// ---- crash simulation ----

size_t MemFile::unflushed_count() const {
  std::lock_guard lk(mu_);
  return unflushed_.size();
}

std::vector<std::byte> MemFile::durable_content() const {
  std::lock_guard lk(mu_);
  return durable_;
}

std::vector<std::byte> MemFile::crash_image(uint64_t seed) const {
  std::lock_guard lk(mu_);
  std::mt19937_64 rng(seed);
  std::vector<const Change*> kept;
  for (const Change& c : unflushed_)
    if (rng() & 1) kept.push_back(&c);
  std::shuffle(kept.begin(), kept.end(), rng);
  std::vector<std::byte> image = durable_;
  for (const Change* c : kept) apply(image, *c);
  return image;
}

void MemFile::apply(std::vector<std::byte>& image, const Change& c) {
  switch (c.kind) {
    case Change::Kind::write:
      if (image.size() < c.off + c.data.size()) image.resize(c.off + c.data.size());
      std::copy(c.data.begin(), c.data.end(), image.begin() + static_cast<std::ptrdiff_t>(c.off));
      break;
    case Change::Kind::zero:
      if (image.size() < c.off + c.len) image.resize(c.off + c.len);
      std::fill_n(image.begin() + static_cast<std::ptrdiff_t>(c.off), c.len, std::byte{0});
      break;
    case Change::Kind::resize: image.resize(c.off); break;
  }
}

}  // namespace qcowfs::io
