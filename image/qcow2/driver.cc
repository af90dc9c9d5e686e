// Qcow2Driver's request path: block status, and the forwarding of writes to
// the writer. Opening is in driver_open.cc, reads in read_path.cc.
#include "image/qcow2/driver.h"

#include <algorithm>
#include <cstring>

#include "image/extent/host_holes.h"
#include "image/qcow2/metadata_prealloc.h"
#include "image/qcow2/writer.h"
#include "image/shrink.h"
#include "io/align.h"
#include "io/buffer.h"

namespace qcowfs::image::qcow2 {
namespace {

constexpr std::string_view kReadOnly = "the qcow2 image is open read-only";

// QEMU's guess whether the image was made with preallocation=metadata, made
// once per image. Only for images open read-only: a writable image's on-disk
// refcounts lag behind its writer, and its header changes under the writer's
// lock; a mount only asks for data versus holes, which the guess never changes.
Task<bool> metadata_preallocated(Qcow2Image& img) {
  using Guess = Qcow2Image::PreallocGuess;
  if (img.file->writable()) co_return false;
  Guess g = img.metadata_prealloc.load(std::memory_order_acquire);
  if (g == Guess::unknown) {
    auto r = co_await detect_metadata_preallocation(*img.file, img.header);
    g = r && *r ? Guess::yes : Guess::no;  // as in QEMU, a failed guess is a no
    img.metadata_prealloc.store(g, std::memory_order_release);
  }
  co_return g == Guess::yes;
}

}  // namespace

Qcow2Driver::Qcow2Driver(std::shared_ptr<Qcow2Image> image, L1Table l1, uint64_t size, bool snapshot_view)
    : image_(std::move(image)), l1_(std::move(l1)), size_(size), read_path_(*image_, l1_, snapshot_view) {}

Qcow2Driver::~Qcow2Driver() = default;

uint64_t Qcow2Driver::size() const { return writer_ ? writer_->size() : size_; }

Task<Status> Qcow2Driver::enable_writes(const ImageOptions& opts) {
  auto layout = co_await build_metadata_layout(*image_->file, image_->header, l1_.entries, image_->snapshots);
  if (!layout) co_return co_await image_->signal_corruption(layout.status().message());
  image_->layout = std::move(*layout);
  auto w = co_await Qcow2Writer::open(*image_, l1_, read_path_, opts);
  if (!w) co_return w.status();
  writer_ = std::move(*w);
  read_path_.lock_reads();
  co_return Status::ok();
}

Task<Status> Qcow2Driver::read(uint64_t guest, std::span<std::byte> buf) {
  if (!image_->legacy_cipher || (is_aligned(guest, crypto::kCryptSectorSize) && is_aligned(buf.size(), crypto::kCryptSectorSize)))
    return read_path_.read(guest, buf);
  return read_whole_sectors(guest, buf);
}

// Legacy AES decrypts whole 512-byte sectors by guest offset: a request that
// cuts one reads the sectors around it.
Task<Status> Qcow2Driver::read_whole_sectors(uint64_t guest, std::span<std::byte> buf) {
  const uint64_t start = align_down(guest, crypto::kCryptSectorSize);
  const uint64_t end = std::min(align_up(guest + buf.size(), crypto::kCryptSectorSize), align_up(size(), crypto::kCryptSectorSize));
  io::AlignedBuffer bounce(static_cast<size_t>(end - start), mem_align(), false);
  QCOWFS_CO_TRY(co_await read_path_.read(start, bounce.span()));
  std::memcpy(buf.data(), bounce.data() + (guest - start), buf.size());
  co_return Status::ok();
}

// Through the read path (ExtentReader::block_status), as qemu-img map shows
// it; where QEMU takes the image for one made with preallocation=metadata,
// holes of the data file inside data ranges are data that reads as zeros.
Task<Result<BlockStatus>> Qcow2Driver::block_status(uint64_t guest, uint64_t len) {
  len = std::min(len, size() - std::min(guest, size()));
  if (len == 0) co_return Status::errorf(EINVAL, "block status query at {:#x} is beyond the end of the image", guest);
  auto b = co_await read_path_.block_status(guest, len);
  if (!b) co_return b.status();
  if (b->depth == 0 && b->data && b->file != nullptr && co_await metadata_preallocated(*image_))
    QCOWFS_CO_TRY(co_await apply_host_holes(*image_->data_file, *b));
  co_return b;
}

Status Qcow2Driver::refuse_write() const {
  if (!writer_) return Status::error(EROFS, std::string(kReadOnly));
  return image_->corruption.refuse_writes();
}

namespace {
Task<Status> write_refused(Status st) { co_return st; }
}  // namespace

// Not a coroutine: the writer's task is the request's (it refuses a corrupt
// image itself), one frame fewer per write.
Task<Status> Qcow2Driver::write(uint64_t guest, std::span<const std::byte> buf) {
  if (!writer_) return write_refused(refuse_write());
  return writer_->write(guest, buf);
}
Task<Status> Qcow2Driver::flush() {
  if (!writer_) co_return Status::ok();
  co_return co_await writer_->flush();
}
Task<Status> Qcow2Driver::discard(uint64_t guest, uint64_t len) {
  QCOWFS_CO_TRY(refuse_write());
  co_return co_await writer_->discard(guest, len);
}
Task<Status> Qcow2Driver::write_zeroes(uint64_t guest, uint64_t len, bool may_unmap) {
  QCOWFS_CO_TRY(refuse_write());
  co_return co_await writer_->write_zeroes(guest, len, may_unmap);
}
Task<Status> Qcow2Driver::truncate(uint64_t new_size) {
  QCOWFS_CO_TRY(refuse_write());
  // Data a backing file shows past the new end counts too (the writer checks this layer).
  if (new_size < size()) QCOWFS_CO_TRY(co_await check_shrink(*this, new_size));
  co_return co_await writer_->truncate(new_size);
}
Task<Status> Qcow2Driver::close() {
  if (!writer_) co_return Status::ok();
  co_return co_await writer_->close();
}
Task<Status> Qcow2Driver::idle_writeback() {
  if (!writer_) co_return Status::ok();
  co_return co_await writer_->idle_writeback();
}

uint64_t Qcow2Driver::allocated_bytes() const {
  uint64_t n = image_->file->allocated_bytes();
  if (image_->data_file_owned) n += image_->data_file_owned->allocated_bytes();
  return n;
}

std::vector<SnapshotInfo> Qcow2Driver::snapshots() const {
  std::vector<SnapshotInfo> out;
  for (const Snapshot& s : image_->snapshots)
    out.push_back(SnapshotInfo{s.id, s.name, s.disk_size, s.vm_state_size, s.date_sec, s.date_nsec, s.vm_clock_nsec});
  return out;
}

Task<Result<std::unique_ptr<BlockDriver>>> Qcow2Driver::open_snapshot(std::string id_or_name) {
  int i = find_snapshot(image_->snapshots, id_or_name);
  if (i < 0) co_return Status::errorf(ENOENT, "{}: no snapshot with ID or name '{}'", image_->path, id_or_name);
  const Snapshot& s = image_->snapshots[static_cast<size_t>(i)];
  if (image_->header.l1_entries_for(s.disk_size) > kMaxL1Bytes / L1Table::kEntryBytes)
    co_return Status::errorf(EINVAL, "{}: snapshot '{}' has an absurd disk size {}", image_->path, id_or_name,
                             s.disk_size);
  auto l1 = co_await read_l1(*image_->file, s.l1_table_offset, s.l1_size);
  if (!l1) co_return l1.status().with_context(fmt::format("{}: snapshot '{}'", image_->path, id_or_name));
  std::unique_ptr<BlockDriver> d = std::make_unique<Qcow2Driver>(image_, std::move(*l1), s.disk_size, true);
  co_return d;
}

const PersistentBitmaps* Qcow2Driver::bitmaps() const {
  if (writer_) return &writer_->bitmaps();
  return ro_bitmaps_.get();
}

void Qcow2Driver::keep_bitmaps(std::unique_ptr<PersistentBitmaps> bitmaps) { ro_bitmaps_ = std::move(bitmaps); }

std::vector<BitmapInfo> Qcow2Driver::dirty_bitmaps() const {
  std::vector<BitmapInfo> out;
  const PersistentBitmaps* b = bitmaps();
  if (!b) return out;
  for (const BitmapSummary& s : b->summaries())
    out.push_back(BitmapInfo{s.entry.name, s.entry.granularity(), s.entry.enabled(), !s.loaded, s.dirty_bytes});
  return out;
}

Result<BitmapRun> Qcow2Driver::bitmap_run(std::string_view name, uint64_t off, uint64_t len) const {
  const PersistentBitmaps* b = bitmaps();
  std::optional<DirtyRun> run;
  if (b) run = b->run_at(name, off, len);
  if (run && run->length != 0) return BitmapRun{run->length, run->dirty};
  if (b)
    for (const BitmapSummary& s : b->summaries())
      if (s.entry.name == name && !s.loaded)
        return Status::errorf(EINVAL, "Bitmap '{}' is inconsistent and cannot be used", name);
  if (run) return Status::errorf(EINVAL, "bitmap '{}': offset {} is past the disk's end", name, off);
  return Status::errorf(ENOENT, "Dirty bitmap '{}' not found", name);
}

}  // namespace qcowfs::image::qcow2
