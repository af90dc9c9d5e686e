// GatedFile: a HostFile over a MemFile whose reads wait until open() is
// called, counting reads in flight: lets the qcow2 tests keep loads pending
// and observe how many host reads a request has issued at once.
#pragma once

#include <algorithm>
#include <memory>
#include <string>

#include "unit/image/forwarding_file.h"
#include "io/host_file.h"
#include "io/mem_file.h"
#include "io/sync.h"

namespace qcowfs::image::qcow2::testing {

class GatedFile final : public qcowfs::testing::ForwardingFile {
 public:
  explicit GatedFile(io::MemFile& f, std::string path = "mem") : ForwardingFile(f), path_(std::move(path)) {}
  void open() { gate_->set(); }
  // Closes the gate again; only while no read waits on it.
  void close() { gate_ = std::make_unique<io::AsyncEvent>(); }
  Task<Result<size_t>> read(uint64_t off, std::span<std::byte> buf) override {
    ++in_flight_;
    max_in_flight_ = std::max(max_in_flight_, in_flight_);
    co_await gate_->wait();
    --in_flight_;
    co_return co_await inner().read(off, buf);
  }
  int in_flight() const { return in_flight_; }
  int max_in_flight() const { return max_in_flight_; }
  bool is_block_device() const override { return false; }
  bool writable() const override { return false; }
  const std::string& path() const override { return path_; }

 private:
  std::string path_;
  std::unique_ptr<io::AsyncEvent> gate_ = std::make_unique<io::AsyncEvent>();
  int in_flight_ = 0;  // touched only on the test's engine thread
  int max_in_flight_ = 0;
};

}  // namespace qcowfs::image::qcow2::testing
