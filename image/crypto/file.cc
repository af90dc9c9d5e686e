#include "image/crypto/file.h"

#include <algorithm>
#include <cstring>

#include "io/align.h"
#include "io/buffer.h"
#include "io/iov.h"

namespace qcowfs::image::crypto {

namespace {
// write_zeroes() encrypts zeros in pieces of this size.
constexpr size_t kZeroChunkBytes = 1 << 20;
}  // namespace

CryptFile::CryptFile(io::HostFile& inner, std::shared_ptr<const SectorCipher> cipher, uint64_t iv_origin)
    : inner_(inner), cipher_(std::move(cipher)), iv_origin_(iv_origin), sector_(cipher_->sector_size()) {}

size_t CryptFile::offset_align() const { return std::max<size_t>(sector_, inner_.offset_align()); }

Status CryptFile::check_range(uint64_t off, uint64_t len) const {
  if (off < iv_origin_ || off + len < off)
    return Status::errorf(EINVAL, "{}: encrypted I/O at {:#x}+{:#x} outside the encrypted area", inner_.path(), off,
                          len);
  return Status::ok();
}

// Whole sectors from start into dst, decrypted in place. Returns the bytes
// read, cut to whole sectors (a file ending inside a sector is corrupt; the
// caller treats the rest as past the end).
Task<Result<size_t>> CryptFile::read_sectors(uint64_t start, std::span<std::byte> dst) {
  auto n = co_await inner_.read(start, dst);
  if (!n) co_return n;
  const size_t whole = align_down(*n, sector_);
  QCOWFS_CO_TRY(co_await decrypt_async(*cipher_, start - iv_origin_, dst.first(whole)));
  co_return whole;
}

Task<Result<size_t>> CryptFile::read(uint64_t off, std::span<std::byte> buf) {
  QCOWFS_CO_TRY(check_range(off, buf.size()));
  if (buf.empty()) co_return size_t{0};
  if (is_aligned(off, sector_) && is_aligned(buf.size(), sector_)) co_return co_await read_sectors(off, buf);
  const uint64_t start = align_down(off, sector_);
  const uint64_t end = align_up(off + buf.size(), sector_);
  io::AlignedBuffer bounce(static_cast<size_t>(end - start), inner_.mem_align(), false);
  auto n = co_await read_sectors(start, bounce.span());
  if (!n) co_return n;
  const size_t skip = static_cast<size_t>(off - start);
  const size_t avail = *n > skip ? std::min(buf.size(), *n - skip) : 0;
  std::memcpy(buf.data(), bounce.data() + skip, avail);
  co_return avail;
}

Task<Result<size_t>> CryptFile::readv(uint64_t off, std::span<const iovec> iov) {
  const size_t len = io::iov_total(iov);
  if (iov.size() == 1) co_return co_await read(off, {static_cast<std::byte*>(iov[0].iov_base), len});
  io::AlignedBuffer gather(len, inner_.mem_align(), false);
  auto n = co_await read(off, gather.span());
  if (!n) co_return n;
  io::copy_to_iov(iov, gather.data(), *n);
  co_return *n;
}

// Encrypts plain (whole sectors from start, a buffer of our own) in place and
// writes it.
Task<Status> CryptFile::write_sectors(uint64_t start, std::span<std::byte> plain) {
  QCOWFS_CO_TRY(co_await encrypt_async(*cipher_, start - iv_origin_, plain));
  co_return co_await inner_.write(start, plain);
}

Task<Status> CryptFile::write(uint64_t off, std::span<const std::byte> buf) {
  iovec one{const_cast<std::byte*>(buf.data()), buf.size()};
  co_return co_await writev(off, {&one, 1});
}

Task<Status> CryptFile::writev(uint64_t off, std::span<const iovec> iov) {
  const uint64_t len = io::iov_total(iov);
  QCOWFS_CO_TRY(check_range(off, len));
  if (len == 0) co_return Status::ok();
  const uint64_t start = align_down(off, sector_);
  const uint64_t end = align_up(off + len, sector_);
  const bool head_partial = !is_aligned(off, sector_);
  const bool tail_partial = !is_aligned(off + len, sector_);
  const auto mode = head_partial || tail_partial ? io::RangeLock::Mode::exclusive : io::RangeLock::Mode::shared;
  auto guard = co_await locks_.lock(start, end, mode);
  io::AlignedBuffer plain(static_cast<size_t>(end - start), inner_.mem_align(), false);
  // The partial head and tail sectors: their old plaintext (zeros past the end).
  auto fill_sector = [&](uint64_t at) -> Task<Status> {
    std::span<std::byte> s = plain.span().subspan(static_cast<size_t>(at - start), sector_);
    auto n = co_await read_sectors(at, s);
    if (!n) co_return n.status();
    std::memset(s.data() + *n, 0, s.size() - *n);
    co_return Status::ok();
  };
  if (head_partial) QCOWFS_CO_TRY(co_await fill_sector(start));
  if (tail_partial && !(head_partial && end - sector_ == start)) QCOWFS_CO_TRY(co_await fill_sector(end - sector_));
  io::copy_from_iov(plain.data() + (off - start), iov, static_cast<size_t>(len));
  QCOWFS_CO_TRY(co_await write_sectors(start, plain.span()));
  // A partial last sector past the old end grew the file to the sector's end:
  // the host file keeps whole sectors, as QEMU's encrypted formats write them.
  co_return Status::ok();
}

Task<Status> CryptFile::write_zeroes(uint64_t off, uint64_t len) {
  QCOWFS_CO_TRY(check_range(off, len));
  if (len == 0) co_return Status::ok();
  const uint64_t a = align_up(off, sector_);
  const uint64_t b = std::max(a, align_down(off + len, sector_));
  if (a != off || b < a) {  // partial head (and maybe the whole range inside one sector)
    const uint64_t head_end = std::min(off + len, a);
    std::vector<std::byte> zeros(static_cast<size_t>(head_end - off));
    QCOWFS_CO_TRY(co_await write(off, zeros));
  }
  if (b < off + len && b >= a) {
    std::vector<std::byte> zeros(static_cast<size_t>(off + len - b));
    QCOWFS_CO_TRY(co_await write(b, zeros));
  }
  for (uint64_t at = a; at < b;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(kZeroChunkBytes, b - at));
    auto guard = co_await locks_.lock(at, at + n, io::RangeLock::Mode::shared);
    io::AlignedBuffer zeros(n, inner_.mem_align(), true);
    QCOWFS_CO_TRY(co_await write_sectors(at, zeros.span()));
    at += n;
  }
  co_return Status::ok();
}

}  // namespace qcowfs::image::crypto
