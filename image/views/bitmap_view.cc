// Bitmap views (bitmap_view.h).
#include "image/views/bitmap_view.h"

#include <algorithm>
#include <cstring>

namespace qcowfs::image {
namespace {

class BitmapView final : public BlockDriver {
 public:
  BitmapView(BlockDriver* disk, std::string name) : disk_(disk), name_(std::move(name)) {}

  std::string_view format_name() const override { return "raw"; }
  uint64_t size() const override { return disk_->size(); }
  bool read_only() const override { return true; }
  size_t mem_align() const override { return disk_->mem_align(); }

  Task<Status> read(uint64_t off, std::span<std::byte> buf) override {
    size_t done = 0;
    while (done < buf.size()) {
      auto run = next_run(off + done, buf.size() - done);
      if (!run) co_return run.status();
      const auto n = static_cast<size_t>(std::min<uint64_t>(run->length, buf.size() - done));
      std::span<std::byte> part = buf.subspan(done, n);
      if (run->dirty) {
        QCOWFS_CO_TRY(co_await disk_->read(off + done, part));
      } else {
        std::memset(part.data(), 0, n);
      }
      done += n;
    }
    co_return Status::ok();
  }
  Task<Status> write(uint64_t, std::span<const std::byte>) override { co_return refuse(); }
  Task<Status> flush() override { co_return Status::ok(); }
  Task<Status> discard(uint64_t, uint64_t) override { co_return refuse(); }
  Task<Status> write_zeroes(uint64_t, uint64_t, bool) override { co_return refuse(); }
  Task<Status> truncate(uint64_t) override { co_return refuse(); }

  Task<Result<BlockStatus>> block_status(uint64_t off, uint64_t len) override {
    auto run = next_run(off, len);
    if (!run) co_return run.status();
    BlockStatus st;
    st.length = run->length;
    st.data = run->dirty;
    st.present = run->dirty;
    st.zero = !run->dirty;
    co_return st;
  }

  // The bytes the dirty granules cover (so that st_blocks tells a copying
  // tool how sparse the view is).
  uint64_t allocated_bytes() const override {
    for (const BitmapInfo& b : disk_->dirty_bitmaps())
      if (b.name == name_) return b.dirty_bytes;
    return 0;
  }
  Task<Status> close() override { co_return Status::ok(); }  // the disk is closed by its owner

 private:
  static Status refuse() { return Status::error(EROFS, "a bitmap view is read-only"); }

  Result<BitmapRun> next_run(uint64_t off, uint64_t len) const {
    auto run = disk_->bitmap_run(name_, off, len);
    if (!run) return Status::errorf(EIO, "bitmap view: {}", run.status().message());
    if (run->length == 0) return Status::errorf(EIO, "bitmap '{}': empty run at offset {}", name_, off);
    return run;
  }

  BlockDriver* disk_;
  const std::string name_;
};

}  // namespace

std::unique_ptr<BlockDriver> make_bitmap_view(BlockDriver* disk, std::string name) {
  return std::make_unique<BitmapView>(disk, std::move(name));
}

}  // namespace qcowfs::image
