// GatedFile: a HostFile over a MemFile whose reads wait until open() is
// called, counting reads in flight: lets the qcow2 tests keep loads pending
// and observe how many host reads a request has issued at once.
#pragma once

#include <algorithm>
#include <memory>
#include <string>

#include "io/host_file.h"
#include "io/mem_file.h"
#include "io/sync.h"

namespace qcowfs::image::qcow2::testing {

class GatedFile final : public io::HostFile {
 public:
  explicit GatedFile(io::MemFile& f, std::string path = "mem") : f_(f), path_(std::move(path)) {}
  void open() { gate_->set(); }
  // Closes the gate again; only while no read waits on it.
  void close() { gate_ = std::make_unique<io::AsyncEvent>(); }
  Task<Result<size_t>> read(uint64_t off, std::span<std::byte> buf) override {
    ++in_flight_;
    max_in_flight_ = std::max(max_in_flight_, in_flight_);
    co_await gate_->wait();
    --in_flight_;
    co_return co_await f_.read(off, buf);
  }
  int in_flight() const { return in_flight_; }
  int max_in_flight() const { return max_in_flight_; }
  Task<Result<size_t>> readv(uint64_t off, std::span<const iovec> iov) override { return f_.readv(off, iov); }
  Task<Status> write(uint64_t off, std::span<const std::byte> b) override { return f_.write(off, b); }
  Task<Status> writev(uint64_t off, std::span<const iovec> iov) override { return f_.writev(off, iov); }
  Task<Status> flush() override { return f_.flush(); }
  Task<Status> discard(uint64_t off, uint64_t len) override { return f_.discard(off, len); }
  Task<Status> write_zeroes(uint64_t off, uint64_t len) override { return f_.write_zeroes(off, len); }
  Task<Status> truncate(uint64_t size) override { return f_.truncate(size); }
  Task<Result<uint64_t>> seek_data(uint64_t off) override { return f_.seek_data(off); }
  Task<Result<uint64_t>> seek_hole(uint64_t off) override { return f_.seek_hole(off); }
  uint64_t size() const override { return f_.size(); }
  uint64_t allocated_bytes() const override { return f_.allocated_bytes(); }
  size_t mem_align() const override { return f_.mem_align(); }
  size_t offset_align() const override { return f_.offset_align(); }
  bool is_block_device() const override { return false; }
  bool writable() const override { return false; }
  io::CacheMode cache_mode() const override { return f_.cache_mode(); }
  const std::string& path() const override { return path_; }

 private:
  io::MemFile& f_;
  std::string path_;
  std::unique_ptr<io::AsyncEvent> gate_ = std::make_unique<io::AsyncEvent>();
  int in_flight_ = 0;  // touched only on the test's engine thread
  int max_in_flight_ = 0;
};

}  // namespace qcowfs::image::qcow2::testing
