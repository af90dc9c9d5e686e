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
      zero_from_(file.size()) {}

Task<Result<HostRun>> VdiWriter::reserve(uint64_t /*first*/, uint64_t n) {
  if (n > h_.blocks_in_image - std::min(blocks_allocated_, h_.blocks_in_image))
    co_return Status::errorf(ENOSPC, "the VDI image has no free blocks left ({} of {} allocated)", blocks_allocated_,
                             h_.blocks_in_image);
  HostRun run;
  run.file = &file_;
  run.host = h_.offset_data + uint64_t{blocks_allocated_} * h_.block_size;
  run.units = n;
  const uint64_t end = run.host + n * h_.block_size;
  if (file_.is_block_device() && end > file_.size())
    co_return Status::errorf(ENOSPC, "the VDI image's block device is full ({} bytes)", file_.size());
  run.fresh = run.host >= zero_from_;
  blocks_allocated_ += static_cast<uint32_t>(n);
  header_dirty_ = true;
  co_return run;
}

// The run's space may hold part of the failed write now: no longer fresh.
void VdiWriter::unreserve(const HostRun& run) {
  blocks_allocated_ -= static_cast<uint32_t>(run.units);
  zero_from_ = std::max(zero_from_, run.host + run.units * h_.block_size);
}

void VdiWriter::publish(uint64_t first, const HostRun& run) {
  const uint64_t bmap_at = h_.offset_bmap - meta_base(h_);
  const auto index = static_cast<uint32_t>((run.host - h_.offset_data) / h_.block_size);
  for (uint64_t i = 0; i < run.units; ++i) {
    const uint64_t block = first + i;
    map_.publish(block, index + static_cast<uint32_t>(i));
    store_le32(meta_.data() + bmap_at + block * sizeof(uint32_t), index + static_cast<uint32_t>(i));
  }
  dirty_.add(first, run.units);
}

void VdiWriter::patch_header(std::byte* header) const {
  store_le32(header + offsetof(HeaderLayout, blocks_allocated), blocks_allocated_);
}

// Every allocated block inside the file (a block written only in part ends
// the file early; QEMU reads past the end as zeros, but the file should hold
// what the header says it does).
Task<Status> VdiWriter::cover_allocated_blocks() {
  const uint64_t end = h_.offset_data + uint64_t{blocks_allocated_} * h_.block_size;
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
    patch_header(header_.data());
    QCOWFS_CO_TRY(co_await file_.write(0, header_.span().first(kHeaderBytes)));
    if (!dirty_.empty()) {
      const auto [from, to] = dirty_.sectors(0, sizeof(uint32_t), sector);
      auto bytes = meta_.span().subspan(static_cast<size_t>(from), static_cast<size_t>(to - from));
      QCOWFS_CO_TRY(co_await file_.write(h_.offset_bmap + from, bytes));
    }
  }
  header_dirty_ = false;
  dirty_.clear();
  co_return Status::ok();
}

}  // namespace qcowfs::image::vdi
