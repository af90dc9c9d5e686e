// LiveDriver: the driver a single-image mount serves, standing in front of the
// image's real driver so that the control socket (fuse/live_snapshot.h) can
// quiesce the image and put a reopened driver in its place while the mount
// stays up.
//
// Every asynchronous call (read, write, flush, discard, write_zeroes,
// truncate, block_status, idle_writeback, close) passes a gate: while the gate
// is open it counts itself in and runs on the current driver; once pause() has
// closed it, new calls wait in a queue (they do not fail) and pause() returns
// when the calls already admitted have finished. The paused owner may then
// replace() the driver; resume() lets the queued calls in, onto the new one.
// The synchronous getters (size(), read_only(), ...) read whichever driver is
// current, without a lock. map_read() is a call of the gate too: it counts
// itself in (or, paused, gives nullopt and the caller reads through read(),
// which queues) and its run keeps the count until the host read is done.
//
// Ownership of replaced drivers: the LiveDriver holds the current driver
// through a shared_ptr, and a snapshot view it opens (open_snapshot(), which
// borrows the driver it came from) holds one too. replace() drops the
// LiveDriver's reference once no getter can still be reading the old driver
// (a getter counts itself in `getters_` around its call, and replace() waits
// for that count to reach zero after the swap: getters never block, so this
// is a short spin); no asynchronous call holds it, since the gate is closed
// and drained. So a replaced driver is destroyed at replace(), or when the
// last snapshot view opened from it goes.
//
// Thread-safety: as BlockDriver; pause(), replace() and resume() are called by
// one owner at a time (the server's main thread), pause() on a thread with an
// Engine (it may wait).
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "image/block_driver.h"
#include "io/sync.h"

namespace qcowfs::fuse {

class LiveDriver final : public image::BlockDriver {
 public:
  explicit LiveDriver(std::unique_ptr<image::BlockDriver> driver);

  // Stops admitting calls and waits for the admitted ones to finish.
  Task<void> pause();
  // Lets the queued calls and every later one in.
  void resume();
  // While paused: the driver calls go to from now on. The previous one
  // (closed by the caller) is destroyed before this returns, unless a
  // snapshot view opened from it still holds it. Null: every call fails with
  // `why` (EIO).
  void replace(std::unique_ptr<image::BlockDriver> driver, Status why = {});
  // Why there is no current driver (the owner's thread only).
  Status broken() const { return broken_; }
  // The current driver (null after a failed reopen).
  image::BlockDriver* current() const { return current_.load(std::memory_order_acquire); }

  std::string_view format_name() const override;
  uint64_t size() const override;
  bool read_only() const override;
  size_t mem_align() const override;
  Task<Status> read(uint64_t off, std::span<std::byte> buf) override;
  std::optional<image::MappedRead> map_read(uint64_t off, uint64_t len) override;
  Task<Status> write(uint64_t off, std::span<const std::byte> buf) override;
  Task<Status> flush() override;
  Task<Status> discard(uint64_t off, uint64_t len) override;
  Task<Status> write_zeroes(uint64_t off, uint64_t len, bool may_unmap) override;
  Task<Status> truncate(uint64_t new_size) override;
  Task<Result<image::BlockStatus>> block_status(uint64_t off, uint64_t len) override;
  uint64_t allocated_bytes() const override;
  Task<Status> close() override;
  Task<Status> idle_writeback() override;
  io::HostFile* identity_file() override;
  image::ImageDetails details() const override;
  std::vector<image::SnapshotInfo> snapshots() const override;
  std::vector<image::BitmapInfo> dirty_bitmaps() const override;
  Result<image::BitmapRun> bitmap_run(std::string_view name, uint64_t off, uint64_t len) const override;
  Task<Result<std::unique_ptr<image::BlockDriver>>> open_snapshot(std::string id_or_name) override;

 private:
  class Admission;  // one admitted call: counted out on destruction
  class Getter;     // one synchronous getter: counted in getters_ for its duration
  struct EnterAwaiter;
  struct DrainAwaiter;
  EnterAwaiter enter();
  void leave();
  static void leave_held(void* live, uint64_t) { static_cast<LiveDriver*>(live)->leave(); }
  // The current driver for an admitted call, or why there is none.
  Result<image::BlockDriver*> admitted_driver() const;

  std::atomic<image::BlockDriver*> current_{nullptr};
  // Owns current_ (with the snapshot views opened from it); changed only while paused.
  std::shared_ptr<image::BlockDriver> owner_;
  mutable std::atomic<uint64_t> getters_{0};  // getters running now (seq_cst, see replace())
  Status broken_;  // why current_ is null; written only while paused

  // The gate. A call counts itself in (admitted_) and goes on unless paused_
  // is set (both seq_cst: either pause() sees the count or the call sees the
  // flag, backs out and queues under mu_). queued_ and drainer_ under mu_.
  std::atomic<uint64_t> admitted_{0};
  std::atomic<bool> paused_{false};
  std::mutex mu_;
  std::vector<io::Waiter> queued_;
  std::optional<io::Waiter> drainer_;
};

}  // namespace qcowfs::fuse
