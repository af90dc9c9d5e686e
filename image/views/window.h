// WindowDriver: a fixed-size window [offset, offset+size) onto a parent
// BlockDriver (a partition of a disk image): every request is shifted by
// offset and forwarded, so the window has the parent's format, caches and
// access mode. The parent is borrowed and must outlive the window.
// Thread-safety: as BlockDriver (the parent does any locking).
#pragma once

#include <algorithm>

#include "image/block_driver.h"

namespace qcowfs::image {

class WindowDriver final : public BlockDriver {
 public:
  WindowDriver(BlockDriver* parent, uint64_t offset, uint64_t size);

  std::string_view format_name() const override { return "raw"; }
  uint64_t size() const override { return size_; }
  bool read_only() const override { return parent_->read_only(); }
  size_t mem_align() const override { return parent_->mem_align(); }

  Task<Status> read(uint64_t off, std::span<std::byte> buf) override;
  std::optional<MappedRead> map_read(uint64_t off, uint64_t len) override;
  Task<Status> write(uint64_t off, std::span<const std::byte> buf) override;
  Task<Status> flush() override;
  Task<Status> discard(uint64_t off, uint64_t len) override;
  Task<Status> write_zeroes(uint64_t off, uint64_t len, bool may_unmap) override;
  // A window is fixed: EINVAL.
  Task<Status> truncate(uint64_t new_size) override;
  Task<Result<BlockStatus>> block_status(uint64_t off, uint64_t len) override;
  // The parent's allocation, capped at the window size (a window cannot tell
  // its own share cheaply).
  uint64_t allocated_bytes() const override { return std::min(parent_->allocated_bytes(), size_); }
  // Flushes (when writable); the parent is closed by its owner.
  Task<Status> close() override;

  uint64_t offset() const { return offset_; }

 private:
  Status check_range(uint64_t off, uint64_t len) const;

  BlockDriver* parent_;
  uint64_t offset_;
  uint64_t size_;
};

}  // namespace qcowfs::image
