#include "image/parallels/writer.h"

#include <algorithm>

#include "image/endian.h"
#include "image/parallels/format.h"
#include "io/align.h"

namespace qcowfs::image::parallels {

uint64_t ParallelsWriter::meta_end(uint64_t clusters) { return align_up(kBatOff + clusters * 4, kSector); }

ParallelsWriter::ParallelsWriter(io::HostFile& file, std::string path, const Header& h, ClusterMap& map,
                                 io::AlignedBuffer meta)
    : file_(file),
      path_(std::move(path)),
      h_(h),
      map_(map),
      meta_(std::move(meta)),
      unit_(h.off_multiplier * kSector),
      zero_from_(file.size()) {
  data_end_ = data_end();
}

// QEMU's s->data_end: data_off (or the end of the BAT), past every cluster a
// BAT entry names; rounded up to a BAT unit so the next entry is whole.
uint64_t ParallelsWriter::data_end() const {
  uint64_t end =
      h_.data_off != 0 ? uint64_t{h_.data_off} * kSector : align_up(kBatOff + h_.bat_entries * 4ull, kSector);
  for (uint64_t c = 0; c < map_.entries(); ++c) {
    const uint32_t e = map_.entry(c);
    if (e != 0) end = std::max(end, uint64_t{e} * unit_ + h_.cluster_size());
  }
  return align_up(end, unit_);
}

Task<Status> ParallelsWriter::write_header(uint32_t inuse) {
  store_le32(meta_.data() + kInuseOff, inuse);
  QCOWFS_CO_TRY(co_await file_.write(0, meta_.span().first(kSector)));
  co_return co_await file_.flush();
}

Task<Status> ParallelsWriter::mark_in_use() { co_return co_await write_header(kInuseMagic); }

Task<Status> ParallelsWriter::close_clean() { co_return co_await write_header(0); }

Task<Result<HostRun>> ParallelsWriter::reserve(uint64_t /*first*/, uint64_t n) {
  const uint64_t end = data_end_ + n * h_.cluster_size();
  if ((end - h_.cluster_size()) / unit_ > UINT32_MAX)
    co_return Status::errorf(ENOSPC, "the Parallels image has no room for more clusters (BAT entries are 32-bit)");
  if (file_.is_block_device() && end > file_.size())
    co_return Status::errorf(ENOSPC, "the Parallels image's block device is full ({} bytes)", file_.size());
  HostRun run;
  run.file = &file_;
  run.host = data_end_;
  run.units = n;
  run.fresh = run.host >= zero_from_;
  data_end_ = end;
  co_return run;
}

// The run's space may hold part of the failed write now: no longer fresh.
void ParallelsWriter::unreserve(const HostRun& run) {
  data_end_ = run.host;
  zero_from_ = std::max(zero_from_, run.host + run.units * h_.cluster_size());
}

void ParallelsWriter::publish(uint64_t first, const HostRun& run) {
  const uint64_t per_cluster = h_.cluster_size() / unit_;
  for (uint64_t i = 0; i < run.units; ++i) {
    const auto e = static_cast<uint32_t>(run.host / unit_ + i * per_cluster);
    map_.publish(first + i, e);
    store_le32(meta_.data() + kBatOff + (first + i) * 4, e);
  }
  dirty_.add(first, run.units);
}

Task<Status> ParallelsWriter::write_metadata() {
  if (!dirty()) co_return Status::ok();
  const auto [from, to] = dirty_.sectors(kBatOff, 4, kSector);
  auto bytes = meta_.span().subspan(static_cast<size_t>(from), static_cast<size_t>(to - from));
  QCOWFS_CO_TRY(co_await file_.write(from, bytes));
  dirty_.clear();
  co_return Status::ok();
}

}  // namespace qcowfs::image::parallels
