// MemFile: an in-memory HostFile for tests, with fault injection. Operations
// complete synchronously (no Engine needed), so a MemFile works inside any
// coroutine and under run_sync alike.
//
// Faults (all one-shot unless noted, checked in this order before the op acts):
//   fail_nth(kind, n, err)  the n-th operation of `kind` from now (1 = the next)
//                           fails with err and changes nothing.
//   fail_from(kind, n, err) like fail_nth, but every later one fails too, until
//                           clear_faults() (a dead disk).
//   short_once(kind, bytes) the next read returns at most `bytes` bytes (a file
//                           that looks shorter); the next write stores only its
//                           first `bytes` bytes and then fails with err (a torn
//                           write).
//   set_size_limit(n)       writes, write_zeroes and truncates that would make
//                           the file longer than n fail with ENOSPC, storing nothing.
// OpKind::any matches every operation kind.
//
// Optional crash simulation (MemFileOptions::track_unflushed): the file keeps
// its content as of the last flush() plus the list of modifications since.
// crash_image(seed) returns one content the host could hold after a power
// loss: each unflushed modification independently kept or lost, the kept ones
// applied in a seed-chosen order.
//
// Allocation is tracked per 4 KiB page: writes allocate, discards of whole
// pages deallocate, so seek_data/seek_hole and allocated_bytes behave like a
// sparse file. Reads of deallocated pages return zeros.
//
// Thread-safety: every method is thread-safe (one mutex).
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "io/host_file.h"

namespace qcowfs::io {

enum class OpKind : uint8_t { read, write, flush, discard, write_zeroes, truncate, seek, any };

struct MemFileOptions {
  size_t mem_align = 4096;   // reported mem_align(); values below 4096 are raised to 4096
  size_t offset_align = 1;   // reported offset_align()
  size_t direct_io_align = 0;  // reported direct_io_align() (0: unknown)
  // Fail requests that break offset_align / mem_align with EINVAL, like a raw
  // O_DIRECT fd. Stricter than the HostFile contract: for tests checking that
  // a caller aligns its I/O when the host asks it to.
  bool reject_unaligned = false;
  bool writable = true;
  bool block_device = false;  // only changes what is_block_device() reports and forbids truncate
  CacheMode cache = CacheMode::writeback;
  std::string path = "mem";
  bool track_unflushed = false;
};

struct MemFileCounters {
  uint64_t reads = 0, writes = 0, flushes = 0, discards = 0, write_zeroes = 0, truncates = 0, seeks = 0;
  uint64_t unaligned = 0;  // reads and writes breaking offset_align or mem_align
  uint64_t bytes_read = 0, bytes_written = 0;
  uint64_t total() const { return reads + writes + flushes + discards + write_zeroes + truncates + seeks; }
};

class MemFile final : public HostFile {
 public:
  explicit MemFile(MemFileOptions opts = {}, std::vector<std::byte> content = {});

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

  uint64_t size() const override;
  uint64_t allocated_bytes() const override;
  size_t mem_align() const override { return mem_align_; }
  size_t offset_align() const override { return opts_.offset_align; }
  size_t direct_io_align() const override { return opts_.direct_io_align; }
  bool is_block_device() const override { return opts_.block_device; }
  bool writable() const override { return opts_.writable; }
  CacheMode cache_mode() const override { return opts_.cache; }
  const std::string& path() const override { return opts_.path; }

  // ---- synchronous versions (the Task methods call these) ----
  Result<size_t> read_now(std::span<const iovec> iov, uint64_t off);
  Status write_now(std::span<const iovec> iov, uint64_t off);

  // ---- fault injection ----
  void fail_nth(OpKind kind, uint64_t nth, int err);
  void fail_from(OpKind kind, uint64_t nth, int err);
  void short_once(OpKind kind, size_t bytes, int err = EIO);
  void set_size_limit(uint64_t limit);
  void clear_faults();  // also lifts the size limit

  // ---- inspection ----
  MemFileCounters counters() const;
  std::vector<std::byte> content() const;
  void set_content(std::vector<std::byte> content);  // all allocated, durable

  // ---- crash simulation (needs track_unflushed) ----
  size_t unflushed_count() const;
  std::vector<std::byte> durable_content() const;  // as of the last flush
  std::vector<std::byte> crash_image(uint64_t seed) const;

 private:
  struct Fault {
    OpKind kind;
    uint64_t countdown;  // matching ops to go; fires at 1
    int err;
    bool sticky;
  };
  struct ShortIo {
    OpKind kind;  // read or write
    size_t bytes;
    int err;
  };
  // One modification since the last flush, replayed by crash_image().
  struct Change {
    enum class Kind : uint8_t { write, zero, resize } kind;
    uint64_t off;                 // write/zero: offset; resize: new size
    uint64_t len;                 // zero: length
    std::vector<std::byte> data;  // write: bytes
  };

  // Counts the op and returns the injected error, if one fires. mu_ held.
  Status begin_op(OpKind kind, const char* what, uint64_t off);
  // First page at or after off whose allocation is `allocated` (SEEK_DATA / SEEK_HOLE).
  Result<uint64_t> seek_page(uint64_t off, bool allocated);
  bool is_unaligned(std::span<const iovec> iov, uint64_t off, uint64_t len) const;
  Status check_growth(uint64_t new_end, const char* what) const;  // mu_ held
  void store(uint64_t off, const std::byte* src, size_t len);     // mu_ held
  void zero_range(uint64_t off, uint64_t len, bool deallocate);   // mu_ held
  void resize(uint64_t size);                                     // mu_ held
  void record(Change c);                                          // mu_ held
  static void apply(std::vector<std::byte>& image, const Change& c);

  const MemFileOptions opts_;
  const size_t mem_align_;
  mutable std::mutex mu_;  // guards everything below
  std::vector<std::byte> data_;
  std::vector<bool> allocated_;  // per 4 KiB page
  std::vector<Fault> faults_;
  std::vector<ShortIo> shorts_;
  uint64_t size_limit_ = UINT64_MAX;
  MemFileCounters counters_;
  std::vector<std::byte> durable_;
  std::vector<Change> unflushed_;
};

}  // namespace qcowfs::io
