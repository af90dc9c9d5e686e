// ForwardingDriver: a BlockDriver that passes every call to the driver it
// wraps, the base of the wrappers that change only a few calls (copy-on-read,
// a shared image's handle, a catalogue view holding its image). A call added
// to BlockDriver is forwarded here once, not in each wrapper.
//
// identity_file() and map_read() are not forwarded: a wrapper may change what
// reads do (copy-on-read fills the image on reads), so passthrough of the
// wrapped file, or reading its host runs, would be wrong by default; a
// wrapper that keeps the bytes forwards them.
//
// Thread-safety: as the wrapped driver's.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "image/block_driver.h"

namespace qcowfs::image {

class ForwardingDriver : public BlockDriver {
 public:
  explicit ForwardingDriver(std::shared_ptr<BlockDriver> inner) : inner_(std::move(inner)) {}

  std::string_view format_name() const override { return inner_->format_name(); }
  uint64_t size() const override { return inner_->size(); }
  bool read_only() const override { return inner_->read_only(); }
  size_t mem_align() const override { return inner_->mem_align(); }
  Task<Status> read(uint64_t off, std::span<std::byte> buf) override { return inner_->read(off, buf); }
  Task<Status> write(uint64_t off, std::span<const std::byte> buf) override { return inner_->write(off, buf); }
  Task<Status> flush() override { return inner_->flush(); }
  Task<Status> discard(uint64_t off, uint64_t len) override { return inner_->discard(off, len); }
  Task<Status> write_zeroes(uint64_t off, uint64_t len, bool may_unmap) override {
    return inner_->write_zeroes(off, len, may_unmap);
  }
  Task<Status> truncate(uint64_t new_size) override { return inner_->truncate(new_size); }
  Task<Result<BlockStatus>> block_status(uint64_t off, uint64_t len) override {
    return inner_->block_status(off, len);
  }
  uint64_t allocated_bytes() const override { return inner_->allocated_bytes(); }
  Task<Status> close() override { return inner_->close(); }
  Task<Status> idle_writeback() override { return inner_->idle_writeback(); }
  ImageDetails details() const override { return inner_->details(); }
  std::vector<SnapshotInfo> snapshots() const override { return inner_->snapshots(); }
  Task<Result<std::unique_ptr<BlockDriver>>> open_snapshot(std::string id_or_name) override {
    return inner_->open_snapshot(std::move(id_or_name));
  }
  std::vector<BitmapInfo> dirty_bitmaps() const override { return inner_->dirty_bitmaps(); }
  Result<BitmapRun> bitmap_run(std::string_view name, uint64_t off, uint64_t len) const override {
    return inner_->bitmap_run(name, off, len);
  }

 protected:
  BlockDriver& inner() const { return *inner_; }
  // Drops the wrapped driver before the wrapper's own members go (for a
  // wrapper whose inner driver borrows what the wrapper then gives back).
  void drop_inner() { inner_.reset(); }

 private:
  std::shared_ptr<BlockDriver> inner_;
};

}  // namespace qcowfs::image
