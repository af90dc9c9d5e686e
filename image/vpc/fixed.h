// A fixed VHD: the guest disk is the file's first bytes, the footer follows.
// Reads go straight to the file (zeros past its end); block status is what
// QEMU 7.2 reports (vpc_co_block_status: data at the same offset, recursing
// into the file so its holes read as "zero": true while staying "data": true).
// Thread-safety: as BlockDriver; immutable after construction.
#pragma once

#include <memory>

#include "image/block_driver.h"

namespace qcowfs::image::vpc {

class FixedDriver final : public BlockDriver {
 public:
  FixedDriver(std::unique_ptr<io::HostFile> file, uint64_t size, ImageDetails details);

  std::string_view format_name() const override { return "vpc"; }
  uint64_t size() const override { return size_; }
  bool read_only() const override { return true; }
  size_t mem_align() const override { return file_->mem_align(); }

  Task<Status> read(uint64_t off, std::span<std::byte> buf) override;
  Task<Status> write(uint64_t off, std::span<const std::byte> buf) override;
  Task<Status> flush() override;
  Task<Status> discard(uint64_t off, uint64_t len) override;
  Task<Status> write_zeroes(uint64_t off, uint64_t len, bool may_unmap) override;
  Task<Status> truncate(uint64_t new_size) override;
  Task<Result<BlockStatus>> block_status(uint64_t off, uint64_t len) override;
  uint64_t allocated_bytes() const override { return file_->allocated_bytes(); }
  Task<Status> close() override;
  ImageDetails details() const override { return details_; }

 private:
  std::unique_ptr<io::HostFile> file_;
  uint64_t size_;
  ImageDetails details_;
};

}  // namespace qcowfs::image::vpc
