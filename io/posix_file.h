// PosixFile: the HostFile for regular files and block devices. Every transfer
// goes through the calling thread's Engine (io::async), so no event-loop thread
// blocks on the host; blocking calls with no async form (ftruncate, lseek,
// BLKDISCARD, BLKZEROOUT) run through io::offload.
//
// Cache modes: none = O_DIRECT, writethrough = O_DSYNC, writeback = page cache
// with fdatasync on flush, unsafe = flush does nothing. With O_DIRECT, a request
// whose offset, length or buffers break the host's alignment goes through an
// aligned bounce buffer: reads read the covering aligned range and copy out;
// writes read-modify-write the partial head/tail blocks under an exclusive
// RangeLock, so overlapping unaligned writes never lose each other's bytes.
// Aligned requests go straight to the host without copies. A request is split
// only where the kernel returns a short count.
//
// Thread-safety: all methods may be called concurrently from any event-loop
// thread. size() is an atomic updated after extending writes and truncates.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "io/fd.h"
#include "io/host_file.h"
#include "io/range_lock.h"

namespace qcowfs::io {

// What the host requires of O_DIRECT transfers.
struct DirectAlignment {
  size_t mem = 1;     // buffer address alignment
  size_t offset = 1;  // file offset and length alignment
};

// Detects O_DIRECT alignment for fd: statx(STATX_DIOALIGN) where reported, the
// logical sector size (BLKSSZGET) for block devices, else by probing O_DIRECT
// reads of 512..4096 bytes at offset 0 (4096 when the file is too small to tell).
// nullopt when statx reports that the file cannot do direct I/O at all.
std::optional<DirectAlignment> detect_direct_alignment(int fd, bool block_device, uint64_t size);
// The probing step alone (fd opened with O_DIRECT; size = its file size).
DirectAlignment probe_direct_alignment(int fd, uint64_t size);

// Opens a file that an image or the user names (an image, an extent, a backing,
// parent or data file, a key file) so that the open can neither block nor touch
// a device: the path is first opened with O_PATH and refused unless it is a
// regular file or a block device (a FIFO, a socket, a directory or a character
// device: EINVAL, "PATH is a FIFO, not a regular file or block device"); then
// opened with flags | O_NONBLOCK | O_NOCTTY | O_CLOEXEC, checked again (the path
// may have been replaced in between), and O_NONBLOCK cleared. what, when not
// empty, prefixes the messages ("the key file"). Failed opens are the errno
// with "opening PATH"; a file under a lease is EWOULDBLOCK rather than a wait.
Result<UniqueFd> open_regular_or_block(const std::string& path, int flags, std::string_view what = {});

class PosixFile final : public HostFile {
 public:
  static Result<std::unique_ptr<PosixFile>> open(const std::string& path, const OpenOptions& opts);
  // The file open at fd (a regular file opened read-write, in cache mode
  // writeback or unsafe), named `name` in messages.
  static Result<std::unique_ptr<PosixFile>> adopt(UniqueFd fd, std::string name, CacheMode cache);

  Task<Result<size_t>> read(uint64_t off, std::span<std::byte> buf) override;
  Task<Result<size_t>> readv(uint64_t off, std::span<const iovec> iov) override;
  Task<Status> write(uint64_t off, std::span<const std::byte> buf) override;
  Task<Status> writev(uint64_t off, std::span<const iovec> iov) override;
  Task<Status> flush() override;
  Task<Status> discard(uint64_t off, uint64_t len) override;
  Task<Status> write_zeroes(uint64_t off, uint64_t len) override;
  Task<Status> truncate(uint64_t size) override;
  Task<Result<uint64_t>> seek_data(uint64_t off) override;
  Task<Result<uint64_t>> seek_hole(uint64_t off) override;

  uint64_t size() const override { return size_.load(std::memory_order_acquire); }
  uint64_t allocated_bytes() const override;
  size_t mem_align() const override { return mem_align_; }
  size_t offset_align() const override { return offset_align_; }
  int kernel_fd() const override { return fd_.get(); }
  size_t direct_io_align() const override { return direct_io_align_; }
  bool is_block_device() const override { return block_device_; }
  bool writable() const override { return writable_; }
  CacheMode cache_mode() const override { return cache_; }
  const std::string& path() const override { return path_; }

 private:
  struct Params {
    UniqueFd fd;
    std::string path;
    CacheMode cache;
    bool writable;
    bool block_device;
    uint64_t size;
    size_t logical_block;  // block devices: BLKSSZGET; files: 1
    DirectAlignment align;   // cache=none: what O_DIRECT needs; else {1, 1}
    size_t direct_io_align;  // see direct_io_align()
  };
  explicit PosixFile(Params p);

  bool direct() const { return cache_ == CacheMode::none; }
  // True when the request may go to the host as it is (always without O_DIRECT).
  bool host_can_take(std::span<const iovec> iov, uint64_t off, uint64_t len) const;
  Status check_engine() const;
  Status check_writable() const;
  void grow_size(uint64_t end);

  Task<Result<size_t>> read_iov(std::span<const iovec> iov, uint64_t off);
  Task<Result<size_t>> read_loop(std::span<const iovec> iov, uint64_t off);
  Task<Result<size_t>> bounce_read(std::span<const iovec> iov, uint64_t off, uint64_t len);
  Task<Status> write_iov(std::span<const iovec> iov, uint64_t off);
  Task<Status> write_loop(std::span<const iovec> iov, uint64_t off, bool lock);
  Task<Status> bounce_write(std::span<const iovec> iov, uint64_t off, uint64_t len);
  Task<Status> read_block(std::byte* dst, uint64_t block_off);
  Task<Status> cut_back_to(uint64_t end);
  Task<Status> write_zero_chunks(uint64_t off, uint64_t len);
  Task<Status> device_zeroout(uint64_t off, uint64_t len);
  Task<Result<uint64_t>> seek(uint64_t off, int whence);
  // Exclusive lock covering [off, off+len) rounded out to host blocks on an
  // O_DIRECT file (end UINT64_MAX = to infinity); an empty guard otherwise.
  Task<RangeLock::Guard> lock_exclusive(uint64_t off, uint64_t end);

  UniqueFd fd_;
  const std::string path_;
  const CacheMode cache_;
  const bool writable_;
  const bool block_device_;
  const size_t logical_block_;
  const size_t dio_mem_align_;  // what the kernel needs of buffer addresses
  const size_t mem_align_;      // what we advertise: max(4096, page size, dio_mem_align_)
  const size_t offset_align_;   // 1 without O_DIRECT
  const size_t direct_io_align_;  // what O_DIRECT would need, in every cache mode (0: unknown)
  std::atomic<uint64_t> size_;
  RangeLock locks_;  // O_DIRECT files only: serialises RMW against overlapping writes
};

}  // namespace qcowfs::io
