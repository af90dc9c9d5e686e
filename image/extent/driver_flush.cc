// ExtentDriver's durability and lifetime: metadata writeback after the data
// it points at, the grace period before unmapped space is reused, growth,
// flush and close. The rules are in image/extent/driver.h and
// image/extent/writer.h.
#include <algorithm>
#include <chrono>

#include "image/extent/driver.h"
#include "io/engine.h"
#include "io/log.h"

namespace qcowfs::image {

// Until every lock-free I/O that entered at or before `epoch` has left
// (InFlightIo::drained, alloc_ held): polled on a timer of the loop, from
// 20 us up to 1 ms apart, so the thread goes on serving (such an I/O never
// waits for the lock).
Task<void> ExtentDriver::grace_period(uint64_t epoch) {
  auto pause = std::chrono::microseconds(20);
  while (!in_flight_.drained(epoch)) {
    co_await io::sleep_for(pause);
    pause = std::min(2 * pause, std::chrono::microseconds(1000));
  }
}

// Unmapped space whose entries are written back and whose grace period is
// over goes back to the writer for reserve() (alloc_ held).
void ExtentDriver::recycle_drained() {
  for (auto it = unmapped_.begin(); it != unmapped_.end();) {
    if (it->written && in_flight_.drained(it->epoch)) {
      img_.writer->recycle(it->space);
      it = unmapped_.erase(it);
    } else {
      ++it;
    }
  }
}

// Growth where the format can (ExtentWriter::grow); shrinking never (no
// format here can shrink in QEMU either).
Task<Status> ExtentDriver::truncate(uint64_t new_size) {
  if (img_.writer == nullptr) co_return refuse_write();
  auto lock = co_await alloc_.lock();
  co_await quiesce(lock);
  const uint64_t now = size();
  if (new_size == now) co_return Status::ok();
  if (!img_.writer->resizable())
    co_return Status::errorf(EINVAL, "{}: {} images cannot be resized (qemu-img resize refuses them too)", img_.path,
                             img_.format);
  if (new_size < now)
    co_return Status::errorf(EINVAL, "{}: {} images cannot shrink (QEMU cannot shrink them either)", img_.path,
                             img_.format);
  Status st = co_await img_.writer->grow(new_size);
  if (!st) co_return st.with_context(img_.path);
  size_.store(new_size, std::memory_order_release);
  co_return Status::ok();
}

Task<Status> ExtentDriver::flush_files() {
  for (const auto& f : img_.files) QCOWFS_CO_TRY(co_await f->flush());
  co_return Status::ok();
}

// Dirty metadata goes to the host after the data it points at is durable.
// Unmapped units are then written back too: their space may be recycled (the
// next write_metadata(), which could name it again, flushes first).
Task<Status> ExtentDriver::writeback() {
  auto lock = co_await alloc_.lock();
  co_await quiesce(lock);
  if (img_.writer->dirty()) {
    QCOWFS_CO_TRY(co_await flush_files());
    Status st = co_await img_.writer->write_metadata();
    if (!st) {
      log::error("{}: writing back {} metadata: {}", img_.path, img_.format, st.message());
      co_return st;
    }
  }
  for (Unmapped& u : unmapped_) u.written = true;
  co_return Status::ok();
}

Task<Status> ExtentDriver::flush() {
  if (img_.writer == nullptr) co_return Status::ok();
  auto one = co_await flushing_.lock();
  QCOWFS_CO_TRY(co_await writeback());
  co_return co_await flush_files();
}

Task<Status> ExtentDriver::idle_writeback() {
  if (img_.writer == nullptr) co_return Status::ok();
  co_return co_await writeback();
}

Task<Status> ExtentDriver::close() {
  if (img_.writer == nullptr || closed_) co_return Status::ok();
  QCOWFS_CO_TRY(co_await flush());
  {
    auto lock = co_await alloc_.lock();
    co_await quiesce(lock);
    QCOWFS_CO_TRY(co_await img_.writer->close_clean());
  }
  QCOWFS_CO_TRY(co_await flush_files());
  closed_ = true;
  co_return Status::ok();
}

Task<Result<HostRun>> InPlaceWriter::reserve(uint64_t /*first*/, uint64_t n) {
  co_return Status::errorf(EIO, "{} units to allocate in an image whose data is all in place", n);
}

}  // namespace qcowfs::image
