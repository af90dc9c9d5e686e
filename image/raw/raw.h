// RawDriver: a raw image, optionally a window [offset, offset+size) onto its
// host file (used for partitions and for raw external data files). Every guest
// byte maps 1:1 onto the host file; discard frees host space only with
// discard=unmap.
// Thread-safety: as BlockDriver; the size is updated atomically by truncate().
#pragma once

#include <atomic>
#include <memory>
#include <optional>
#include <string>

#include "image/block_driver.h"
#include "image/create.h"

namespace qcowfs::image {

class RawDriver final : public BlockDriver {
 public:
  // Owns the file. A window (offset, size) is fixed-size; without one the
  // guest size follows the host file.
  RawDriver(std::unique_ptr<io::HostFile> file, bool discard_unmap, uint64_t offset = 0,
            std::optional<uint64_t> size = std::nullopt);
  // Borrows the file (must outlive the driver): for windows and data files.
  RawDriver(io::HostFile* file, bool discard_unmap, uint64_t offset = 0,
            std::optional<uint64_t> size = std::nullopt);

  std::string_view format_name() const override { return "raw"; }
  uint64_t size() const override;
  bool read_only() const override { return !file_->writable(); }
  size_t mem_align() const override { return file_->mem_align(); }

  Task<Status> read(uint64_t off, std::span<std::byte> buf) override;
  std::optional<MappedRead> map_read(uint64_t off, uint64_t) override { return MappedRead(file_, offset_ + off); }
  Task<Status> write(uint64_t off, std::span<const std::byte> buf) override;
  Task<Status> flush() override;
  Task<Status> discard(uint64_t off, uint64_t len) override;
  Task<Status> write_zeroes(uint64_t off, uint64_t len, bool may_unmap) override;
  Task<Status> truncate(uint64_t new_size) override;
  Task<Result<BlockStatus>> block_status(uint64_t off, uint64_t len) override;
  uint64_t allocated_bytes() const override { return file_->allocated_bytes(); }
  Task<Status> close() override;
  io::HostFile* identity_file() override;
  // No cluster size, backing file or format data; "dirty-flag": false, as qemu-img info shows a raw image.
  ImageDetails details() const override;

  io::HostFile& file() { return *file_; }

 private:
  std::unique_ptr<io::HostFile> owned_;
  io::HostFile* file_;
  bool discard_unmap_;
  uint64_t offset_;
  std::optional<uint64_t> window_size_;
};

// The registry's entry point (image/format.h): a raw image over the whole file.
Task<Result<std::unique_ptr<BlockDriver>>> open_raw(std::unique_ptr<io::HostFile> file, std::string path,
                                                    ImageOptions opts);

// Makes `file` (new or emptied, writable) a raw image of `size` bytes; with
// `allocate` every byte is also given host space (write_zeroes), as qemu-img's
// preallocation=falloc|full does. Flushes before it returns.
Task<Status> create_raw(io::HostFile& file, uint64_t size, bool allocate);

// `qcowfs create -f raw`, the registry's PrepareCreateFn (image/create.h):
// size= and preallocation=off|metadata|falloc|full (falloc and full give every
// byte host space); no backing file, no encryption (that is -f luks).
Result<std::unique_ptr<Creator>> prepare_raw_create(const CreateRequest& request);

}  // namespace qcowfs::image
