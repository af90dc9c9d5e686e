// ImageFile: one raw view shown by the mount: the main image (opened before
// mounting), a persistent dirty bitmap of it (a view it owns), an internal
// snapshot (opened read-only on first open(), since most mounts never look
// at their snapshots), or an image of a catalogue
// (fuse/catalogue.h: opened on the first open of its view, closed when it has
// been unused for the idle delay). It answers the questions the FUSE handlers
// ask about a file: its driver, size, allocation, access mode.
//
// Catalogue images count their users: acquire() (each OPEN, and a resize by
// path for its duration) opens the image if needed, release() (each RELEASE)
// gives it back, and close_if_idle() closes an image nobody has used for the
// idle delay. The states, guarded by mu_:
//   closed --acquire()--> open (users > 0) --release() to 0--> idle
//   idle --acquire()--> open;  idle --close_if_idle() after the delay--> closed
// A failed open leaves the view closed; the next open tries again.
//
// Thread-safety: every method may be called from any event-loop thread.
// ensure_open()/acquire() serialise the lazy open; driver() is valid (non-null)
// once they succeeded and stays valid until close() (a snapshot) or until the
// last release() plus close_if_idle() (a catalogue image): the kernel sends I/O
// only on an open file, so every I/O request runs while a user holds it. A
// snapshot view borrows its parent driver's files: it must be closed before the
// parent.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "image/block_driver.h"
#include "io/status.h"
#include "io/sync.h"
#include "io/task.h"

namespace qcowfs::fuse {

// Told about every completed write or zeroing of a view, in disk offsets (the
// partitions/ directory uses it to notice a changed partition table).
// Thread-safety: note_write() is called from any event-loop thread.
class WriteWatch {
 public:
  virtual ~WriteWatch() = default;
  virtual void note_write(uint64_t disk_offset, uint64_t len) = 0;
};

class ImageFile {
 public:
  // The main view over an opened driver (borrowed, must outlive this object).
  ImageFile(image::BlockDriver* driver, bool writable);
  // A read-only view the file owns, open from the start (a bitmap of the
  // main image: image/views/bitmap_view.h; it borrows the main driver).
  explicit ImageFile(std::unique_ptr<image::BlockDriver> view);
  // A read-only snapshot of parent (borrowed), opened lazily by id.
  ImageFile(image::BlockDriver* parent, std::string snapshot_id, uint64_t snapshot_size);
  // A catalogue image, opened by `opener` on first acquire(); until then its
  // size and allocation are the ones last given to set_closed_attributes().
  using Opener = std::function<Task<Result<std::unique_ptr<image::BlockDriver>>>()>;
  using Clock = std::chrono::steady_clock;
  ImageFile(Opener opener, bool writable);
  ImageFile(const ImageFile&) = delete;
  ImageFile& operator=(const ImageFile&) = delete;

  // The snapshot this view shows (snapshots/), "" for any other view.
  const std::string& snapshot_id() const { return snapshot_id_; }
  // Opens the snapshot on first use; a no-op for the main view.
  Task<Status> ensure_open();
  // The driver, or nullptr for a snapshot not opened yet.
  image::BlockDriver* driver() const { return driver_.load(std::memory_order_acquire); }

  uint64_t size() const;
  uint64_t allocated_bytes() const;
  bool writable() const { return writable_; }
  uint64_t mem_align() const;

  // The host file the kernel may serve every open of this view from (FUSE
  // passthrough), else nullptr. The kernel cannot mix passed-through and
  // ordinary opens of one file (the latter fail with EIO), so this is all or
  // nothing: the main view of a raw image over a whole regular file, mounted
  // read-only, on a host whose O_DIRECT alignment is at most a 512-byte sector
  // (so sector-aligned O_DIRECT reads, which the daemon would bounce, still work).
  io::HostFile* passthrough_file() const;
  // From now on, opens are served by the kernel from backing `id`.
  void enable_passthrough(int32_t id) { backing_id_.store(id, std::memory_order_release); }
  // The backing id opens pass through to, or -1.
  int32_t backing_id() const { return backing_id_.load(std::memory_order_acquire); }

  // Writes to this view from now on are reported to `watch` (borrowed, must
  // outlive this object), shifted by disk_offset (where the view starts on the
  // disk). Set while building the tree, before any request.
  void watch_writes(WriteWatch* watch, uint64_t disk_offset) {
    watch_ = watch;
    watch_offset_ = disk_offset;
  }
  // Called when a write or zeroing of [off, off+len) of this view completed.
  void note_write(uint64_t off, uint64_t len) const {
    if (watch_) watch_->note_write(watch_offset_ + off, len);
  }

  // Closes a lazily opened snapshot or catalogue image, or an owned view; the
  // main view's driver is closed by its owner.
  Task<Status> close();

  // ---- catalogue images ----
  bool counts_users() const { return static_cast<bool>(opener_); }
  // Opens the image if it is not open and counts one user (the caller then
  // holds it until release()). A failure leaves the view closed.
  Task<Status> acquire();
  // Counts one user without waiting, when the image is open: false otherwise
  // (then acquire()).
  bool try_acquire();
  // One user fewer; when none is left, `on_idle` (set_on_idle) is told.
  void release();
  void set_on_idle(std::function<void()> on_idle) { on_idle_ = std::move(on_idle); }
  // Closes the image if it is open, unused, and was last released at least
  // `delay` before `now`. Returns when the image may be closed next: nullopt
  // when it is closed (or in use: its last release will tell on_idle).
  Task<Result<std::optional<Clock::time_point>>> close_if_idle(Clock::time_point now, Clock::duration delay);
  // Closes the image now if it is open and nobody uses it; never waits for an
  // open under way (its opener may be waiting on what the caller holds, e.g.
  // a paused LiveDriver). False: in use, or being opened.
  Task<Result<bool>> close_if_unused();
  // The size and host allocation a closed image shows (from its header).
  void set_closed_attributes(uint64_t size, uint64_t allocated);
  bool is_open() const;

 private:
  // The close both close_if_* share, for an unused image with open_mu_ held.
  // unpublish_locked() (mu_ held, in the critical section that found no user,
  // so try_acquire() cannot slip in): keeps the size and allocation for stat
  // and hides the driver; close_unpublished() then closes and drops it.
  void unpublish_locked();
  Task<Status> close_unpublished();

  image::BlockDriver* parent_ = nullptr;  // snapshot views only
  std::string snapshot_id_;
  uint64_t snapshot_size_ = 0;
  bool writable_ = false;
  io::AsyncMutex open_mu_;                         // guards owned_ during the lazy open
  std::unique_ptr<image::BlockDriver> owned_;      // an opened snapshot, or an owned view
  std::atomic<image::BlockDriver*> driver_{nullptr};
  std::atomic<int32_t> backing_id_{-1};
  WriteWatch* watch_ = nullptr;
  uint64_t watch_offset_ = 0;

  // Catalogue images: owned_ and driver_ change under open_mu_ (the open and
  // the close) and, for driver_, also under mu_, which guards the rest; size()
  // and allocated_bytes() read the driver under mu_.
  Opener opener_;
  std::function<void()> on_idle_;
  mutable std::mutex mu_;
  unsigned users_ = 0;
  Clock::time_point last_release_{};
  uint64_t closed_size_ = 0;
  uint64_t closed_allocated_ = 0;
};

}  // namespace qcowfs::fuse
