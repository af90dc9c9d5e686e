// Qcow2Driver: a BlockDriver over one qcow2 image, or over one of its internal
// snapshots. The image-wide state (header, files, backing driver, caches,
// snapshot table, corruption state) lives in a shared Qcow2Image
// (image/qcow2/image_state.h); each driver is a view of it with its own L1
// table, guest size and ReadPath, so snapshot views share the host file, data
// file, backing file and L2 cache with the active image.
//
// Reads and block_status go through the view's ReadPath (image/qcow2/read_path.h).
// A driver opened writable (the active image only, never a snapshot view) owns
// a Qcow2Writer (image/qcow2/writer.h) and forwards write, flush, discard,
// write_zeroes, truncate, idle_writeback and close to it; the writer reads old
// data through the same ReadPath and shares its guest range lock.
//
// Opening (driver_open.cc): header, L1 table, snapshot table, data file,
// backing chain, caches; then enable_writes() for a writable image.
//
// Thread-safety: as BlockDriver. See image_state.h for what may change while
// the image is open and under which lock.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "image/block_driver.h"
#include "image/qcow2/image_state.h"
#include "image/qcow2/read_path.h"

namespace qcowfs::image::qcow2 {

class PersistentBitmaps;
class Qcow2Writer;

class Qcow2Driver final : public BlockDriver {
 public:
  Qcow2Driver(std::shared_ptr<Qcow2Image> image, L1Table l1, uint64_t size, bool snapshot_view);
  ~Qcow2Driver() override;

  // Makes this (active image) driver writable: loads the refcounts, rebuilding
  // them first when the image is dirty.
  Task<Status> enable_writes(const ImageOptions& opts);

  std::string_view format_name() const override { return "qcow2"; }
  uint64_t size() const override;
  bool read_only() const override { return writer_ == nullptr; }
  size_t mem_align() const override { return image_->data_file->mem_align(); }

  Task<Status> read(uint64_t guest, std::span<std::byte> buf) override;
  std::optional<MappedRead> map_read(uint64_t guest, uint64_t len) override { return read_path_.map_read(guest, len); }
  Task<Status> write(uint64_t guest, std::span<const std::byte> buf) override;
  Task<Status> flush() override;
  Task<Status> discard(uint64_t guest, uint64_t len) override;
  Task<Status> write_zeroes(uint64_t guest, uint64_t len, bool may_unmap) override;
  Task<Status> truncate(uint64_t new_size) override;
  Task<Result<BlockStatus>> block_status(uint64_t guest, uint64_t len) override;
  uint64_t allocated_bytes() const override;
  Task<Status> close() override;
  Task<Status> idle_writeback() override;

  std::vector<SnapshotInfo> snapshots() const override;
  Task<Result<std::unique_ptr<BlockDriver>>> open_snapshot(std::string id_or_name) override;

  // The persistent bitmaps: the writer's (live) on a writable image, else the
  // ones a read-only open of the active image handed to keep_bitmaps().
  std::vector<BitmapInfo> dirty_bitmaps() const override;
  Result<BitmapRun> bitmap_run(std::string_view name, uint64_t off, uint64_t len) const override;
  void keep_bitmaps(std::unique_ptr<PersistentBitmaps> bitmaps);

  const Qcow2Image& image() const { return *image_; }
  const L1Table& l1_table() const { return l1_; }
  Qcow2Writer* writer() { return writer_.get(); }

 private:
  Status refuse_write() const;  // EROFS or EIO: why this view takes no writes, or ok
  Task<Status> read_whole_sectors(uint64_t guest, std::span<std::byte> buf);
  const PersistentBitmaps* bitmaps() const;

  std::shared_ptr<Qcow2Image> image_;
  L1Table l1_;
  uint64_t size_;
  ReadPath read_path_;  // reads l1_
  std::unique_ptr<Qcow2Writer> writer_;
  std::unique_ptr<PersistentBitmaps> ro_bitmaps_;  // read-only active image: its bitmaps, loaded at open
};

// Reads the L1 table of `entries` entries at `offset` (driver_open.cc).
Task<Result<L1Table>> read_l1(io::HostFile& f, HostOffset offset, uint32_t entries);

}  // namespace qcowfs::image::qcow2
