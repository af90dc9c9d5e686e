// ImageFile: one raw view shown by the mount: the main image (opened before
// mounting) or an internal snapshot (opened read-only on first open(), since
// most mounts never look at their snapshots). It answers the questions the
// FUSE handlers ask about a file: its driver, size, allocation, access mode.
//
// Thread-safety: every method may be called from any event-loop thread.
// ensure_open() serialises the lazy open; driver() is valid (non-null) once
// ensure_open() succeeded and stays valid until close(). A snapshot view
// borrows its parent driver's files: it must be closed before the parent.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
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
  // A read-only snapshot of parent (borrowed), opened lazily by id.
  ImageFile(image::BlockDriver* parent, std::string snapshot_id, uint64_t snapshot_size);
  ImageFile(const ImageFile&) = delete;
  ImageFile& operator=(const ImageFile&) = delete;

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

  // Closes a lazily opened snapshot; the main view's driver is closed by its owner.
  Task<Status> close();

 private:
  image::BlockDriver* parent_ = nullptr;  // snapshot views only
  std::string snapshot_id_;
  uint64_t snapshot_size_ = 0;
  bool writable_ = false;
  io::AsyncMutex open_mu_;                         // guards owned_ during the lazy open
  std::unique_ptr<image::BlockDriver> owned_;      // an opened snapshot
  std::atomic<image::BlockDriver*> driver_{nullptr};
  std::atomic<int32_t> backing_id_{-1};
  WriteWatch* watch_ = nullptr;
  uint64_t watch_offset_ = 0;
};

}  // namespace qcowfs::fuse
