#include "image/vhdx/writer.h"

#include <algorithm>
#include <iterator>
#include <vector>

#include "image/vhdx/format.h"

namespace qcowfs::image::vhdx {

VhdxWriter::VhdxWriter(io::HostFile& file, std::string path, const Params& p, BatMap& map, HeaderPair headers)
    : file_(file),
      path_(std::move(path)),
      g_(p.geometry),
      h_(p.header),
      map_(map),
      headers_(std::move(headers)),
      tail_{p.first_free, file.size()},
      next_sequence_(p.next_sequence),
      headers_updated_(p.headers_updated),
      leave_blocks_allocated_(p.leave_blocks_allocated) {}

Task<Status> VhdxWriter::before_first_write() {
  if (headers_updated_) co_return Status::ok();
  QCOWFS_CO_TRY(co_await headers_.update_both(true, nullptr));
  headers_updated_ = true;
  co_return Status::ok();
}

// The slices holding the blocks' entries stay loaded until publish().
Task<Status> VhdxWriter::prepare(uint64_t first, uint64_t n) {
  for (uint64_t block = first; block < first + n; ++block)
    QCOWFS_CO_TRY(co_await slices_.pin(map_.cache(), map_.slice_host(g_.bat_index(block * g_.block_size)),
                                       path_ + ": the VHDX BAT"));
  co_return Status::ok();
}

// Recycled space first, else as vhdx_allocate_block: at the end of the file
// rounded up to 1 MiB, the file extended over the new blocks at once.
Task<Result<HostRun>> VhdxWriter::reserve(uint64_t /*first*/, uint64_t n) {
  auto reused = co_await reuse(n);
  if (!reused) co_return reused.status();
  if (reused->units != 0) co_return *reused;
  const uint64_t end = tail_.next + n * g_.block_size;
  if (file_.is_block_device()) {
    if (end > file_.size())
      co_return Status::errorf(ENOSPC, "the VHDX image's block device is full ({} bytes)", file_.size());
  } else if (end > file_.size()) {
    QCOWFS_CO_TRY(co_await file_.truncate(end));
  }
  co_return tail_.take(file_, n, g_.block_size);
}

// n contiguous recycled blocks (the first piece of free_ that holds them),
// zeroed in one host operation: a write racing with their discard may have
// left bytes there after the punch. A run with no units: none to be had.
Task<Result<HostRun>> VhdxWriter::reuse(uint64_t n) {
  const uint64_t bytes = n * g_.block_size;
  auto it = std::find_if(free_.begin(), free_.end(), [&](const auto& piece) {
    return piece.second >= n && (!file_.is_block_device() || piece.first + bytes <= file_.size());
  });
  if (it == free_.end()) co_return HostRun{};
  const auto [host, blocks] = *it;
  free_.erase(it);
  if (blocks > n) free_.emplace(host + bytes, blocks - n);
  Status st = co_await file_.write_zeroes(host, bytes);
  if (!st) {
    add_free(host, n);
    co_return st.with_context(fmt::format("zeroing reused VHDX blocks at {:#x}", host));
  }
  reused_.insert(host);
  co_return HostRun{&file_, host, n, true};
}

void VhdxWriter::unreserve(const HostRun& run) {
  if (reused_.erase(run.host) != 0) {
    add_free(run.host, run.units);
    return;
  }
  tail_.give_back(run, g_.block_size);
}

void VhdxWriter::store(uint64_t block, uint64_t entry) {
  const uint64_t index = g_.bat_index(block * g_.block_size);
  TableCache::Ref& slice = slices_.change(map_.cache(), map_.slice_host(index));
  BatMap::store_entry(slice, BatMap::offset_in_slice(index), entry);
}

void VhdxWriter::publish(uint64_t first, const HostRun& run) {
  reused_.erase(run.host);
  for (uint64_t i = 0; i < run.units; ++i) store(first + i, (run.host + i * g_.block_size) | kFullyPresent);
}

// FileOffsetMB 0: the space belongs to no entry once this is written back.
void VhdxWriter::unmap(uint64_t first, uint64_t n) {
  for (uint64_t block = first; block < first + n; ++block) store(block, kUnmapped);
}

void VhdxWriter::recycle(const HostRun& space) { add_free(space.host, space.units); }

// Adds n blocks at host to free_, merged with the pieces around them.
void VhdxWriter::add_free(uint64_t host, uint64_t n) {
  const uint64_t bs = g_.block_size;
  auto next = free_.lower_bound(host);
  if (next != free_.end() && host + n * bs == next->first) {
    n += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second * bs == host) {
      prev->second += n;
      return;
    }
  }
  free_.emplace_hint(next, host, n);
}

// The changed BAT sectors, as few log entries as the log allows.
Task<Status> VhdxWriter::write_metadata() {
  slices_.release_pins();  // no allocation is in flight (ExtentDriver::quiesce)
  if (!dirty()) co_return Status::ok();
  const uint64_t per_entry = max_entry_sectors(h_.log_length);
  if (per_entry == 0) co_return Status::errorf(EIO, "{}: the VHDX log is too small to write", path_);
  while (slices_.dirty()) {
    std::vector<SectorWrite> sectors;
    std::vector<SliceSet::Key> written;
    for (const auto& [key, ref] : slices_.dirty_slices()) {
      if (sectors.size() == per_entry) break;
      sectors.push_back(SectorWrite{key.second, ref.bytes()});
      written.push_back(key);
    }
    QCOWFS_CO_TRY(co_await log_write_and_flush(file_, headers_, h_, next_sequence_, sectors, path_));
    ++next_sequence_;
    for (const SliceSet::Key& k : written) slices_.erase(k);
  }
  co_return Status::ok();
}

}  // namespace qcowfs::image::vhdx
