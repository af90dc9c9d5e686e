#include "image/copy_on_read.h"

#include <algorithm>
#include <cstring>

#include "image/forwarding_driver.h"
#include "io/buffer.h"
#include "io/range_lock.h"

namespace qcowfs::image {
namespace {

// Where the driver names no cluster size: QEMU's bdrv_get_cluster_size()
// falls back to the request alignment; 64 KiB (qcow2's default cluster) keeps
// the copies few without copying much more than was read.
constexpr uint64_t kDefaultCopyCluster = 64 * 1024;
// The most one copy reads and writes at once (QEMU's MAX_BOUNCE_BUFFER).
constexpr uint64_t kMaxCopyBytes = 16u << 20;

// Allocated in the top image: the top layer records the bytes (data or zeros).
bool in_top(const BlockStatus& s) { return s.present && s.depth == 0; }

bool all_zero(std::span<const std::byte> b) {
  return std::all_of(b.begin(), b.end(), [](std::byte x) { return x == std::byte{0}; });
}

class CopyOnReadDriver final : public ForwardingDriver {
 public:
  CopyOnReadDriver(std::unique_ptr<BlockDriver> inner, uint64_t cluster)
      : ForwardingDriver(std::move(inner)), cluster_(cluster) {}

  Task<Status> read(uint64_t off, std::span<std::byte> buf) override;
  Task<Status> write(uint64_t off, std::span<const std::byte> buf) override {
    auto guard = co_await lock_.lock(padded_start(off), padded_end(off + buf.size()), io::RangeLock::Mode::shared);
    co_return co_await inner().write(off, buf);
  }
  Task<Status> discard(uint64_t off, uint64_t len) override {
    auto guard = co_await lock_.lock(padded_start(off), padded_end(off + len), io::RangeLock::Mode::shared);
    co_return co_await inner().discard(off, len);
  }
  Task<Status> write_zeroes(uint64_t off, uint64_t len, bool may_unmap) override {
    auto guard = co_await lock_.lock(padded_start(off), padded_end(off + len), io::RangeLock::Mode::shared);
    co_return co_await inner().write_zeroes(off, len, may_unmap);
  }
  Task<Status> truncate(uint64_t new_size) override {
    auto guard = co_await lock_.lock(0, UINT64_MAX, io::RangeLock::Mode::exclusive);
    co_return co_await inner().truncate(new_size);
  }

 private:
  uint64_t padded_start(uint64_t off) const { return off / cluster_ * cluster_; }
  uint64_t padded_end(uint64_t end) const {
    const uint64_t up = end % cluster_ == 0 ? end : (end / cluster_ + 1) * cluster_;
    return std::min(up, std::max(end, inner().size()));
  }
  Task<Status> copy_clusters(uint64_t start, uint64_t end, uint64_t off, std::span<std::byte> buf);
  Task<Status> copy_run(uint64_t at, uint64_t n, uint64_t off, std::span<std::byte> buf);
  Task<Status> read_part(uint64_t at, uint64_t n, uint64_t off, std::span<std::byte> buf);

  const uint64_t cluster_;
  // Copies hold their padded clusters exclusive; guest writes, discards and
  // write-zeroes hold theirs shared; truncate holds everything.
  io::RangeLock lock_;
};

Task<Status> CopyOnReadDriver::read(uint64_t off, std::span<std::byte> buf) {
  if (buf.empty()) co_return Status::ok();
  auto first = co_await inner().block_status(off, buf.size());
  if (!first) co_return first.status();
  if (in_top(*first) && first->length >= buf.size()) co_return co_await inner().read(off, buf);
  const uint64_t start = padded_start(off), end = padded_end(off + buf.size());
  auto guard = co_await lock_.lock(start, end, io::RangeLock::Mode::exclusive);
  co_return co_await copy_clusters(start, end, off, buf);
}

// Under the exclusive lock of [start, end): copies every run of it that is not
// allocated in the top image (asked again now: a guest write may have
// allocated some meanwhile) and fills the guest's buf (at off) from the copies
// and from the top image.
Task<Status> CopyOnReadDriver::copy_clusters(uint64_t start, uint64_t end, uint64_t off,
                                             std::span<std::byte> buf) {
  for (uint64_t at = start; at < end;) {
    auto s = co_await inner().block_status(at, end - at);
    if (!s) co_return s.status();
    const uint64_t n = std::min(s->length, end - at);
    if (n == 0) co_return Status::errorf(EIO, "copy-on-read: empty block status at {}", at);
    if (in_top(*s)) {
      QCOWFS_CO_TRY(co_await read_part(at, n, off, buf));
      at += n;
    } else {
      const uint64_t chunk = std::min(n, kMaxCopyBytes);
      QCOWFS_CO_TRY(co_await copy_run(at, chunk, off, buf));
      at += chunk;
    }
  }
  co_return Status::ok();
}

// Reads the part of [at, at + n) that the guest asked for straight into buf.
Task<Status> CopyOnReadDriver::read_part(uint64_t at, uint64_t n, uint64_t off, std::span<std::byte> buf) {
  const uint64_t lo = std::max(at, off), hi = std::min(at + n, off + buf.size());
  if (lo >= hi) co_return Status::ok();
  co_return co_await inner().read(lo, buf.subspan(lo - off, hi - lo));
}

// Reads [at, at + n) through the chain, writes it into the top image and
// hands the guest its part.
Task<Status> CopyOnReadDriver::copy_run(uint64_t at, uint64_t n, uint64_t off, std::span<std::byte> buf) {
  io::AlignedBuffer bounce(static_cast<size_t>(n), inner().mem_align(), false);
  QCOWFS_CO_TRY(co_await inner().read(at, bounce.span()));
  Status w;
  if (all_zero(bounce.span())) {
    w = co_await inner().write_zeroes(at, n, false);
  } else {
    w = co_await inner().write(at, bounce.span());
  }
  if (!w) co_return w.with_context("copy-on-read");
  const uint64_t lo = std::max(at, off), hi = std::min(at + n, off + buf.size());
  if (lo < hi) std::memcpy(buf.data() + (lo - off), bounce.data() + (lo - at), hi - lo);
  co_return Status::ok();
}

}  // namespace

Result<std::unique_ptr<BlockDriver>> make_copy_on_read(std::unique_ptr<BlockDriver> inner) {
  if (inner->read_only())
    return Status::errorf(EINVAL, "copy-on-read needs a read-write mount (the {} image is opened read-only; QEMU: "
                                  "\"Can't use copy-on-read on read-only device\")",
                          inner->format_name());
  // Drivers that name no cluster size (qcow2's details() is empty: its info
  // comes from describe) are padded to 64 KiB, qcow2's default; a larger
  // cluster is completed by the format's own copy-on-write from the backing.
  const uint64_t cluster = inner->details().cluster_size;
  return std::unique_ptr<BlockDriver>(
      std::make_unique<CopyOnReadDriver>(std::move(inner), cluster != 0 ? cluster : kDefaultCopyCluster));
}

}  // namespace qcowfs::image
