// FakeDriver: a BlockDriver for fuse/ unit tests that stores nothing: a
// fixed size and access mode, a list of snapshots, and counters of snapshot
// opens and closes. Reads and writes succeed and do nothing.
// Thread-safety: the counters are atomic; the rest is fixed at construction.
#pragma once

#include <atomic>
#include <cerrno>
#include <memory>
#include <string>
#include <vector>

#include "image/block_driver.h"

namespace qcowfs::fuse::fakes {

// A driver with a fixed size and a list of snapshots; counts snapshot opens.
class FakeDriver final : public image::BlockDriver {
 public:
  FakeDriver(uint64_t size, bool ro, std::vector<image::SnapshotInfo> snaps = {})
      : size_(size), ro_(ro), snaps_(std::move(snaps)) {}
  std::string_view format_name() const override { return "fake"; }
  uint64_t size() const override { return size_; }
  bool read_only() const override { return ro_; }
  size_t mem_align() const override { return 4096; }
  Task<Status> read(uint64_t, std::span<std::byte>) override { co_return Status::ok(); }
  Task<Status> write(uint64_t, std::span<const std::byte>) override { co_return Status::ok(); }
  Task<Status> flush() override { co_return Status::ok(); }
  Task<Status> discard(uint64_t, uint64_t) override { co_return Status::ok(); }
  Task<Status> write_zeroes(uint64_t, uint64_t, bool) override { co_return Status::ok(); }
  Task<Status> truncate(uint64_t) override { co_return Status::ok(); }
  Task<Result<image::BlockStatus>> block_status(uint64_t, uint64_t len) override {
    image::BlockStatus st;
    st.length = len;
    co_return st;
  }
  uint64_t allocated_bytes() const override { return 3 * 512 + 1; }
  Task<Status> close() override {
    ++closes;
    co_return Status::ok();
  }
  std::vector<image::SnapshotInfo> snapshots() const override { return snaps_; }
  Task<Result<std::unique_ptr<image::BlockDriver>>> open_snapshot(std::string id) override {
    ++snapshot_opens;
    for (const auto& s : snaps_)
      if (s.id == id) {
        std::unique_ptr<image::BlockDriver> d = std::make_unique<FakeDriver>(s.disk_size, true);
        co_return d;
      }
    co_return Status::errorf(ENOENT, "no snapshot {}", id);
  }

  // A snapshot taken or deleted (tests run on one thread).
  void set_snapshots(std::vector<image::SnapshotInfo> snaps) { snaps_ = std::move(snaps); }

  std::atomic<int> snapshot_opens{0};
  std::atomic<int> closes{0};

 private:
  uint64_t size_;
  bool ro_;
  std::vector<image::SnapshotInfo> snaps_;
};

}  // namespace qcowfs::fuse::fakes
