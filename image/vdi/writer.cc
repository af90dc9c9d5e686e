#include "image/vdi/writer.h"

#include <algorithm>
#include <cstddef>

#include "image/endian.h"
#include "image/vdi/format.h"
#include "io/align.h"

namespace qcowfs::image::vdi {

uint64_t VdiWriter::meta_base(const Header& h) { return h.offset_bmap <= kMaxJointMetadataGap ? 0 : h.offset_bmap; }

uint64_t VdiWriter::meta_end(const Header& h) {
  return align_up(uint64_t{h.offset_bmap} + h.blocks_for_disk() * sizeof(uint32_t), uint64_t{kSectorSize});
}

VdiWriter::VdiWriter(io::HostFile& file, std::string path, const Header& h, VdiMap& map, io::AlignedBuffer header_bytes,
                     io::AlignedBuffer meta)
    : file_(file),
      path_(std::move(path)),
      h_(h),
      map_(map),
      header_(std::move(header_bytes)),
      meta_(std::move(meta)),
      blocks_allocated_(h.blocks_allocated),
      disk_allocated_(h.blocks_allocated),
      zero_from_(file.size()) {
  if (!compacts()) return;
  owner_.assign(blocks_allocated_, kUnallocated);
  for (uint64_t block = 0; block < map_.blocks(); ++block) {
    const uint32_t index = map_.entry(block);
    if (is_allocated(index) && index < owner_.size()) owner_[index] = static_cast<uint32_t>(block);
  }
  moving_ = std::vector<std::atomic<uint64_t>>((map_.blocks() + 63) / 64);
}

// A compaction's vacated blocks are handed out only once its commit is
// durable (sync_vacated()); the space handed out no longer reads as zeros.
Task<Result<HostRun>> VdiWriter::reserve(uint64_t /*first*/, uint64_t n) {
  if (n > h_.blocks_in_image - std::min(blocks_allocated_, h_.blocks_in_image))
    co_return Status::errorf(ENOSPC, "the VDI image has no free blocks left ({} of {} allocated)", blocks_allocated_,
                             h_.blocks_in_image);
  align_data_area();
  HostRun run;
  run.file = &file_;
  run.host = data_end();
  run.units = n;
  const uint64_t end = run.host + n * h_.block_size;
  if (file_.is_block_device() && end > file_.size())
    co_return Status::errorf(ENOSPC, "the VDI image's block device is full ({} bytes)", file_.size());
  if (unsynced_) QCOWFS_CO_TRY(co_await sync_vacated());
  run.fresh = run.host >= zero_from_;
  zero_from_ = std::max(zero_from_, end);
  blocks_allocated_ += static_cast<uint32_t>(n);
  if (compacts()) owner_.resize(blocks_allocated_, kUnallocated);
  header_dirty_ = true;
  co_return run;
}

// Before the first block of an image with none allocated (and none on disk,
// nothing vacated): a data area that starts off kDataAlign (1 MiB, as
// VirtualBox aligns it) or off the host's alignment (qemu-img puts it right
// after the block map, at 4608 bytes for small disks) moves to the next
// aligned offset, so that every data block is aligned: the host need not
// serialize unaligned direct writes (ext4 does), and a 1 MiB write is one
// aligned MiB of the host file, not one split over two of the host disk's own
// chunks. The header's offset_data changes with the next write-back, in the
// same write as the first entry that names a block (or before it).
void VdiWriter::align_data_area() {
  if (blocks_allocated_ != 0 || disk_allocated_ != 0 || vacated_end_ != 0 || unsynced_) return;
  const uint64_t align = std::max<uint64_t>(kDataAlign, file_.offset_align());
  const uint64_t aligned = align_up(uint64_t{h_.offset_data}, align);
  if (aligned == h_.offset_data || aligned > UINT32_MAX) return;
  // A block device keeps the layout when the moved data area would not fit.
  if (file_.is_block_device() && aligned + uint64_t{h_.blocks_in_image} * h_.block_size > file_.size()) return;
  h_.offset_data = static_cast<uint32_t>(aligned);
  map_.set_offset_data(h_.offset_data);
  header_dirty_ = true;
}

void VdiWriter::unreserve(const HostRun& run) {
  blocks_allocated_ -= static_cast<uint32_t>(run.units);
  if (compacts()) owner_.resize(blocks_allocated_);
}

// The block map entry in the VdiMap (for readers) and in the bytes written back.
void VdiWriter::set_entry(uint64_t block, uint32_t entry) {
  map_.publish(block, entry);
  store_le32(meta_.data() + (h_.offset_bmap - meta_base(h_)) + block * sizeof(uint32_t), entry);
  dirty_.add(block, 1);
}

void VdiWriter::publish(uint64_t first, const HostRun& run) {
  const auto index = static_cast<uint32_t>((run.host - h_.offset_data) / h_.block_size);
  for (uint64_t i = 0; i < run.units; ++i) {
    set_entry(first + i, index + static_cast<uint32_t>(i));
    if (compacts()) owner_[index + i] = static_cast<uint32_t>(first + i);
  }
}

// VDI_DISCARDED, as VirtualBox marks a discarded block; the data block is
// freed by the compaction that follows.
void VdiWriter::unmap(uint64_t first, uint64_t n) {
  for (uint64_t block = first; block < first + n; ++block) {
    const uint32_t index = map_.entry(block);
    set_entry(block, kDiscarded);
    if (index < owner_.size()) owner_[index] = kUnallocated;
    freed_.push_back(Freed{block, index});
  }
}

void VdiWriter::set_moving(uint64_t block, bool moving) {
  const uint64_t bit = uint64_t{1} << (block % 64);
  if (moving) {
    moving_[block / 64].fetch_or(bit);
  } else {
    moving_[block / 64].fetch_and(~bit);
  }
}

bool VdiWriter::needs_before_unit_write(uint64_t unit) const {
  return unit / 64 < moving_.size() && (moving_[unit / 64].load() >> (unit % 64) & 1) != 0;
}

// The count after the discard is blocks_allocated - freed; every data block
// at or past it that a block still owns moves into a freed data block below
// it (there are as many of those as such owners, or more where the image had
// leaked data blocks: those stay leaked).
std::vector<UnitMove> VdiWriter::begin_compaction() {
  const auto count = static_cast<uint32_t>(blocks_allocated_ - freed_.size());
  std::vector<uint32_t> holes;
  for (const Freed& f : freed_)
    if (f.index < count) holes.push_back(f.index);
  std::sort(holes.begin(), holes.end());
  moves_.clear();
  size_t next = 0;
  for (uint32_t index = count; index < blocks_allocated_ && next < holes.size(); ++index) {
    const uint32_t block = owner_[index];
    if (block == kUnallocated) continue;
    moves_.push_back(UnitMove{block, place(index), place(holes[next++])});
    set_moving(block, true);
  }
  return moves_;
}

void VdiWriter::commit_compaction() {
  for (const UnitMove& m : moves_) {
    const auto to = static_cast<uint32_t>((m.to.host - h_.offset_data) / h_.block_size);
    const auto from = static_cast<uint32_t>((m.from.host - h_.offset_data) / h_.block_size);
    set_entry(m.unit, to);
    owner_[to] = static_cast<uint32_t>(m.unit);
    owner_[from] = kUnallocated;
  }
  vacated_end_ = std::max(vacated_end_, data_end());
  blocks_allocated_ -= static_cast<uint32_t>(freed_.size());
  owner_.resize(blocks_allocated_);
  header_dirty_ = true;
  unsynced_ = true;
  freed_.clear();
}

void VdiWriter::cancel_compaction() {
  for (const Freed& f : freed_) {
    set_entry(f.block, f.index);
    if (f.index < owner_.size()) owner_[f.index] = static_cast<uint32_t>(f.block);
  }
  freed_.clear();
  for (const UnitMove& m : moves_) set_moving(m.unit, false);
  moves_.clear();
}

Task<Status> VdiWriter::end_compaction(bool durable) {
  for (const UnitMove& m : moves_) set_moving(m.unit, false);
  moves_.clear();
  if (durable) unsynced_ = false;
  if (unsynced_) co_return Status::ok();
  co_return co_await give_back_vacated();
}

// A committed compaction whose write-back failed: written back and flushed
// before a new block takes a vacated data block (on disk an old entry may
// still name it). The data of every published entry is complete: flushed
// first.
Task<Status> VdiWriter::sync_vacated() {
  QCOWFS_CO_TRY(co_await file_.flush());
  QCOWFS_CO_TRY(co_await write_metadata());
  QCOWFS_CO_TRY(co_await file_.flush());
  unsynced_ = false;
  co_return Status::ok();
}

// The vacated data blocks past the allocated ones back to the host: the file
// cut after the last allocated block when nothing follows them (it then reads
// as zeros from there on), else punched.
Task<Status> VdiWriter::give_back_vacated() {
  const uint64_t end = data_end();
  if (vacated_end_ <= end) {
    vacated_end_ = 0;
    co_return Status::ok();
  }
  if (!file_.is_block_device() && file_.size() <= vacated_end_) {
    if (file_.size() > end) QCOWFS_CO_TRY(co_await file_.truncate(end));
    zero_from_ = std::min(zero_from_, end);
  } else {
    QCOWFS_CO_TRY(co_await file_.discard(end, vacated_end_ - end));
  }
  vacated_end_ = 0;
  co_return Status::ok();
}

// After the final write-back and flush: nothing is in flight and the
// metadata is durable.
Task<Status> VdiWriter::close_clean() {
  unsynced_ = false;
  co_return co_await give_back_vacated();
}

void VdiWriter::patch_header(std::byte* header) const {
  store_le32(header + offsetof(HeaderLayout, blocks_allocated), blocks_allocated_);
  store_le32(header + offsetof(HeaderLayout, offset_data), h_.offset_data);
}

// Every allocated block inside the file (a block written only in part ends
// the file early; QEMU reads past the end as zeros, but the file should hold
// what the header says it does).
Task<Status> VdiWriter::cover_allocated_blocks() {
  const uint64_t end = data_end();
  if (file_.is_block_device() || file_.size() >= end) co_return Status::ok();
  co_return co_await file_.truncate(end);
}

Task<Status> VdiWriter::write_metadata() {
  if (!dirty()) co_return Status::ok();
  QCOWFS_CO_TRY(co_await cover_allocated_blocks());
  const uint64_t bmap_at = h_.offset_bmap - meta_base(h_);
  const uint64_t sector = kSectorSize;
  if (joint()) {
    patch_header(meta_.data());
    const uint64_t end =
        !dirty_.empty() ? dirty_.sectors(bmap_at, sizeof(uint32_t), sector).second : uint64_t{kHeaderBytes};
    QCOWFS_CO_TRY(co_await file_.write(0, meta_.span().first(static_cast<size_t>(end))));
  } else {
    // No entry on disk at or past the count on disk, between the two writes.
    const bool shrank = blocks_allocated_ < disk_allocated_;
    patch_header(header_.data());
    if (!shrank) QCOWFS_CO_TRY(co_await file_.write(0, header_.span().first(kHeaderBytes)));
    if (!dirty_.empty()) {
      const auto [from, to] = dirty_.sectors(0, sizeof(uint32_t), sector);
      auto bytes = meta_.span().subspan(static_cast<size_t>(from), static_cast<size_t>(to - from));
      QCOWFS_CO_TRY(co_await file_.write(h_.offset_bmap + from, bytes));
    }
    if (shrank) QCOWFS_CO_TRY(co_await file_.write(0, header_.span().first(kHeaderBytes)));
  }
  disk_allocated_ = blocks_allocated_;
  header_dirty_ = false;
  dirty_.clear();
  co_return Status::ok();
}

}  // namespace qcowfs::image::vdi
