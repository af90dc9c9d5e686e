#include "image/qcow2/metadata.h"

#include "image/endian.h"
#include "image/qcow2/format.h"
#include "io/when_all.h"

namespace qcowfs::image::qcow2 {

bool MetadataTracker::touch_l2(uint64_t offset) {
  auto it = l2_.find(offset);
  if (it == l2_.end()) return false;
  it->second.gen = ++l2_gen_;
  return true;
}

void MetadataTracker::add_l2(TableCache::Ref ref, TableCache& cache) {
  cache.mark_dirty(ref);
  uint64_t offset = ref.host_offset();
  l2_.insert_or_assign(offset, DirtySlice{std::move(ref), ++l2_gen_});
}

WritebackBatch MetadataTracker::take(const RefcountTable& rt, const std::vector<uint64_t>& l1, uint64_t l1_offset) {
  WritebackBatch b;
  b.blocks = rt.dirty_blocks();
  b.reftable_entries = rt.dirty_table_entries();
  b.reftable_offset = rt.table_offset();
  for (const auto& [host, s] : l2_) {
    auto bytes = s.ref.bytes();
    b.l2.push_back(WritebackBatch::Slice{host, {bytes.begin(), bytes.end()}, s.gen});
  }
  for (const auto& [index, gen] : l1_dirty_) b.l1_entries.emplace_back(index, l1[index]);
  b.l1_offset = l1_offset;
  b.l1_gen = l1_gen_;
  b.releases = std::move(releases_);
  releases_.clear();
  b.data_written = data_written_;
  data_written_ = false;
  return b;
}

void MetadataTracker::written(const WritebackBatch& b, RefcountTable& rt, TableCache& cache) {
  for (const auto& blk : b.blocks) rt.mark_block_written(blk.index, blk.gen);
  for (const auto& [index, value] : b.reftable_entries) rt.mark_table_entry_written(index, value);
  for (const auto& s : b.l2) {
    auto it = l2_.find(s.offset);
    if (it == l2_.end() || it->second.gen != s.gen) continue;
    cache.clear_dirty(it->second.ref);
    l2_.erase(it);
  }
  // An L1 entry changed again meanwhile has a newer generation: keep it dirty.
  for (auto it = l1_dirty_.begin(); it != l1_dirty_.end();) {
    if (it->second <= b.l1_gen) it = l1_dirty_.erase(it);
    else ++it;
  }
}

void MetadataTracker::failed(const WritebackBatch& b) {
  releases_.insert(releases_.begin(), b.releases.begin(), b.releases.end());
  data_written_ = data_written_ || b.data_written;
}

namespace {

Task<Status> write_u64(io::HostFile& f, HostOffset host, uint64_t v) {
  std::byte buf[8];
  store_be64(buf, v);
  co_return co_await f.write(host, std::span<const std::byte>(buf, sizeof buf));
}

Task<Status> write_bytes(io::HostFile& f, HostOffset host, const std::vector<std::byte>& bytes) {
  co_return co_await f.write(host, std::span<const std::byte>(bytes.data(), bytes.size()));
}

Task<Status> flush_all(io::HostFile& file, io::HostFile& data_file) {
  if (&data_file != &file) QCOWFS_CO_TRY(co_await data_file.flush());
  co_return co_await file.flush();
}

}  // namespace

Task<Status> write_batch(io::HostFile& file, io::HostFile& data_file, const WritebackBatch& b) {
  // Stage 1: refcount blocks, then the reftable entries naming new blocks.
  std::vector<Task<Status>> writes;
  for (const auto& blk : b.blocks) writes.push_back(write_bytes(file, blk.host_offset, blk.bytes));
  QCOWFS_CO_TRY(co_await io::when_all(std::move(writes)));
  QCOWFS_CO_TRY(co_await flush_all(file, data_file));
  if (!b.reftable_entries.empty()) {
    writes.clear();
    for (const auto& [index, value] : b.reftable_entries)
      writes.push_back(write_u64(file, b.reftable_offset + index * kReftableEntrySize, value));
    QCOWFS_CO_TRY(co_await io::when_all(std::move(writes)));
    QCOWFS_CO_TRY(co_await file.flush());
  }
  // Stage 2: L2 slices, then L1 entries (which may point at new L2 tables).
  if (b.l2.empty() && b.l1_entries.empty()) co_return Status::ok();
  writes.clear();
  for (const auto& s : b.l2) writes.push_back(write_bytes(file, s.offset, s.bytes));
  QCOWFS_CO_TRY(co_await io::when_all(std::move(writes)));
  if (!b.l1_entries.empty()) {
    QCOWFS_CO_TRY(co_await file.flush());
    writes.clear();
    for (const auto& [index, value] : b.l1_entries)
      writes.push_back(write_u64(file, b.l1_offset + index * kL1EntrySize, value));
    QCOWFS_CO_TRY(co_await io::when_all(std::move(writes)));
  }
  // Stage 3: everything durable before the caller applies the releases.
  co_return co_await file.flush();
}

}  // namespace qcowfs::image::qcow2
