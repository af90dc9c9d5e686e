#include "image/qcow2/refcount.h"

#include <algorithm>
#include <cstring>

#include "image/endian.h"
#include "image/qcow2/format.h"
#include "io/align.h"
#include "io/log.h"

namespace qcowfs::image::qcow2 {

Task<Status> write_reftable_location(io::HostFile& file, HostOffset table, uint32_t table_clusters) {
  static_assert(offsetof(HeaderLayout, refcount_table_clusters) == offsetof(HeaderLayout, refcount_table_offset) + sizeof(uint64_t));
  std::byte fields[sizeof(uint64_t) + sizeof(uint32_t)];
  store_be64(fields, table);
  store_be32(fields + sizeof(uint64_t), table_clusters);
  co_return co_await file.write(offsetof(HeaderLayout, refcount_table_offset), std::span<const std::byte>(fields, sizeof fields));
}

io::AlignedBuffer serialize_reftable(std::span<const uint64_t> table, size_t bytes, size_t mem_align) {
  io::AlignedBuffer buf(bytes, mem_align, true);
  for (size_t i = 0; i < table.size(); ++i) store_be64(buf.data() + i * kReftableEntrySize, table[i]);
  return buf;
}

RefcountTable::RefcountTable(io::HostFile& file, uint32_t cluster_bits, uint32_t refcount_order,
                             uint64_t table_offset, std::vector<uint64_t> table, size_t cache_blocks)
    : file_(file),
      map_(cluster_bits, refcount_order),
      table_offset_(table_offset),
      table_(std::move(table)),
      cache_blocks_(std::max<size_t>(cache_blocks, 4)) {}

Task<Result<std::unique_ptr<RefcountTable>>> RefcountTable::load(io::HostFile& file, uint32_t cluster_bits,
                                                                 uint32_t refcount_order, uint64_t table_offset,
                                                                 uint32_t table_clusters, size_t cache_blocks) {
  size_t bytes = size_t{table_clusters} << cluster_bits;
  io::AlignedBuffer buf(bytes, file.mem_align(), true);
  auto n = co_await file.read(table_offset, buf.span());
  if (!n) co_return n.status().with_context("reading the refcount table");
  if (*n != bytes) co_return Status::errorf(EIO, "refcount table at {:#x} is truncated by the end of the file", table_offset);
  std::vector<uint64_t> table(bytes / kReftableEntrySize);
  for (size_t i = 0; i < table.size(); ++i) {
    table[i] = load_be64(buf.data() + i * kReftableEntrySize) & kReftableOffsetMask;
    if (table[i] != 0 && !is_aligned(table[i], uint64_t{1} << cluster_bits))
      co_return Status::errorf(EIO, "refcount block offset {:#x} (reftable entry {}) is not cluster aligned", table[i], i);
  }
  co_return std::make_unique<RefcountTable>(file, cluster_bits, refcount_order, table_offset, std::move(table),
                                            cache_blocks);
}

uint32_t RefcountTable::table_clusters() const {
  return static_cast<uint32_t>(map_.table_clusters_for(table_.size()));
}

RefcountTable::BlockPtr RefcountTable::cached(uint64_t index) const {
  auto it = blocks_.find(index);
  return it == blocks_.end() ? nullptr : it->second;
}

void RefcountTable::evict() {
  for (auto it = blocks_.begin(); it != blocks_.end() && blocks_.size() >= cache_blocks_;) {
    if (!it->second->dirty() && it->second.use_count() == 1) it = blocks_.erase(it);
    else ++it;
  }
}

Task<Result<RefcountTable::BlockPtr>> RefcountTable::block(uint64_t index) {
  if (auto b = cached(index)) co_return b;
  if (!has_block(index)) co_return Status::errorf(EIO, "refcount block {} does not exist", index);
  auto b = std::make_shared<Block>();
  b->host_offset = table_[index];
  b->data = io::AlignedBuffer(static_cast<size_t>(cluster_size()), file_.mem_align(), false);
  auto n = co_await file_.read(b->host_offset, b->data.span());
  if (!n) co_return n.status().with_context(fmt::format("reading refcount block at {:#x}", b->host_offset));
  if (*n != b->data.size())
    co_return Status::errorf(EIO, "refcount block at {:#x} is truncated by the end of the file", b->host_offset);
  // Another coroutine may have loaded it meanwhile (callers hold the metadata
  // lock, but load_block_for may run from read-only scans).
  if (auto other = cached(index)) co_return other;
  evict();
  blocks_.emplace(index, b);
  co_return b;
}

std::optional<uint64_t> RefcountTable::peek(HostCluster hc) const {
  uint64_t index = map_.table_index(hc);
  if (!has_block(index)) return uint64_t{0};
  auto b = cached(index);
  if (!b) return std::nullopt;
  return map_.get(b->data.span(), hc);
}

Task<Status> RefcountTable::load_block_for(HostCluster hc) {
  uint64_t index = map_.table_index(hc);
  if (!has_block(index) || cached(index)) co_return Status::ok();
  auto b = co_await block(index);
  if (!b) co_return b.status();
  co_return Status::ok();
}

Task<Result<uint64_t>> RefcountTable::get(HostCluster hc) {
  uint64_t index = map_.table_index(hc);
  if (!has_block(index)) co_return uint64_t{0};
  auto b = co_await block(index);
  if (!b) co_return b.status();
  co_return map_.get((*b)->data.span(), hc);
}

Task<Status> RefcountTable::add(HostCluster first_hc, uint64_t n, int64_t delta) {
  const uint64_t maxv = map_.max();
  const uint32_t bits = map_.cluster_bits();
  // Check every entry first so that a failure changes nothing.
  for (HostCluster hc = first_hc; hc < first_hc + n; ++hc) {
    uint64_t index = map_.table_index(hc);
    if (!has_block(index)) {
      corruption_found_ = true;
      co_return Status::errorf(EIO, "refcount update of cluster {:#x}: no refcount block covers it", hc);
    }
    auto b = co_await block(index);
    if (!b) co_return b.status();
    uint64_t v = map_.get((*b)->data.span(), hc);
    bool bad = delta >= 0 ? maxv - v < static_cast<uint64_t>(delta) : v < static_cast<uint64_t>(-delta);
    if (bad) {
      corruption_found_ = true;
      log::error("refcount of host cluster {:#x} would leave [0, {}] ({} {:+})", hc << bits, maxv, v, delta);
      co_return Status::errorf(EIO, "refcount {} of host cluster {:#x} {} ", v, hc << bits,
                               delta >= 0 ? "overflows" : "underflows");
    }
  }
  for (HostCluster hc = first_hc; hc < first_hc + n; ++hc) {
    auto b = co_await block(map_.table_index(hc));
    if (!b) co_return b.status();
    Block& blk = **b;
    map_.set(blk.data.span(), hc, map_.get(blk.data.span(), hc) + static_cast<uint64_t>(delta));
    ++blk.gen;
  }
  co_return Status::ok();
}

void RefcountTable::install_block(uint64_t index, HostCluster hc) {
  auto b = std::make_shared<Block>();
  b->host_offset = hc << map_.cluster_bits();
  b->data = io::AlignedBuffer(static_cast<size_t>(cluster_size()), file_.mem_align(), true);
  b->gen = 1;
  if (index >= table_.size()) table_.resize(index + 1, 0);
  table_[index] = b->host_offset;
  dirty_table_.insert(index);
  evict();
  blocks_[index] = std::move(b);
}

Task<Status> RefcountTable::write_blocks_now() {
  for (auto& [index, b] : blocks_) {
    if (!b->dirty()) continue;
    QCOWFS_CO_TRY(co_await file_.write(b->host_offset, b->data.span()));
    b->written_gen = b->gen;
  }
  co_return Status::ok();
}

// Every block index the range [at_hc, at_hc + table_clusters + new blocks)
// touches must exist; new blocks cover themselves, so this is a fixpoint.
std::vector<uint64_t> RefcountTable::missing_blocks(HostCluster at_hc, uint64_t table_clusters) const {
  std::vector<uint64_t> missing;
  for (size_t prev = SIZE_MAX; prev != missing.size();) {
    prev = missing.size();
    missing.clear();
    HostCluster end_hc = at_hc + table_clusters + prev;
    for (uint64_t r = map_.table_index(at_hc); r <= map_.table_index(end_hc - 1); ++r)
      if (!has_block(r)) missing.push_back(r);
  }
  return missing;
}

// At least 1.5 times the current size, and large enough to name the blocks
// covering the new table and blocks themselves.
RefcountTable::Growth RefcountTable::plan_growth(uint64_t min_entries, HostCluster at_hc) const {
  uint64_t entries = std::max<uint64_t>(min_entries, table_.size() + table_.size() / 2 + 1);
  for (;;) {
    Growth g;
    g.table_clusters = map_.table_clusters_for(entries);
    g.missing = missing_blocks(at_hc, g.table_clusters);
    uint64_t last_index = map_.table_index(at_hc + g.table_clusters + g.missing.size() - 1);
    if (last_index < g.table_clusters * cluster_size() / kReftableEntrySize) return g;
    entries = last_index + 1;
  }
}

Task<Status> RefcountTable::write_grown(HostCluster at_hc, uint64_t table_clusters) {
  const uint64_t cs = cluster_size();
  QCOWFS_CO_TRY(co_await write_blocks_now());
  io::AlignedBuffer buf = serialize_reftable(table_, static_cast<size_t>(table_clusters * cs), file_.mem_align());
  QCOWFS_CO_TRY(co_await file_.write(at_hc * cs, buf.span()));
  QCOWFS_CO_TRY(co_await file_.flush());
  QCOWFS_CO_TRY(co_await write_reftable_location(file_, at_hc * cs, static_cast<uint32_t>(table_clusters)));
  co_return co_await file_.flush();
}

Task<Result<HostCluster>> RefcountTable::grow(uint64_t min_entries, HostCluster at_hc) {
  const uint64_t cs = cluster_size();
  const Growth g = plan_growth(min_entries, at_hc);
  const uint64_t tc = g.table_clusters;
  if (tc * cs > kMaxRefcountTableBytes)
    co_return Status::errorf(EFBIG, "refcount table would exceed {} bytes", kMaxRefcountTableBytes);
  std::vector<uint64_t> old_table = table_;
  uint64_t old_offset = table_offset();
  uint32_t old_clusters = table_clusters();
  table_.resize(tc * cs / kReftableEntrySize, 0);
  HostCluster next_hc = at_hc + tc;
  for (uint64_t r : g.missing) install_block(r, next_hc++);
  Status st = co_await add(at_hc, next_hc - at_hc, +1);
  if (st) st = co_await write_grown(at_hc, tc);
  if (!st) {
    // The header still names the old table: forget the new one. Blocks already
    // written stay valid (they only count clusters nothing references yet).
    for (uint64_t r : g.missing) blocks_.erase(r);
    table_ = std::move(old_table);
    for (uint64_t r : g.missing) dirty_table_.erase(r);
    co_return st;
  }
  table_offset_.store(at_hc * cs, std::memory_order_release);
  dirty_table_.clear();
  log::debug("refcount table grown to {} clusters at {:#x}", tc, at_hc * cs);
  QCOWFS_CO_TRY(co_await add(old_offset / cs, old_clusters, -1));
  co_return next_hc;
}

std::vector<RefcountTable::DirtyBlock> RefcountTable::dirty_blocks() const {
  std::vector<DirtyBlock> out;
  for (const auto& [index, b] : blocks_) {
    if (!b->dirty()) continue;
    out.push_back(DirtyBlock{index, b->host_offset, {b->data.data(), b->data.data() + b->data.size()}, b->gen});
  }
  return out;
}

void RefcountTable::mark_block_written(uint64_t index, uint64_t gen) {
  if (auto b = cached(index); b && b->written_gen < gen) b->written_gen = gen;
}

std::vector<std::pair<uint64_t, uint64_t>> RefcountTable::dirty_table_entries() const {
  std::vector<std::pair<uint64_t, uint64_t>> out;
  for (uint64_t i : dirty_table_) out.emplace_back(i, table_[i]);
  return out;
}

void RefcountTable::mark_table_entry_written(uint64_t index, uint64_t value) {
  if (index < table_.size() && table_[index] == value) dirty_table_.erase(index);
}

bool RefcountTable::has_dirty() const { return !dirty_table_.empty() || dirty_block_count() > 0; }

size_t RefcountTable::dirty_block_count() const {
  size_t n = 0;
  for (const auto& [index, b] : blocks_) n += b->dirty() ? 1 : 0;
  return n;
}

Task<Result<HostCluster>> RefcountTable::end_of_used() {
  const uint64_t per = block_entries();
  for (uint64_t r = table_.size(); r-- > 0;) {
    if (!has_block(r)) continue;
    auto b = co_await block(r);
    if (!b) co_return b.status();
    for (uint64_t i = per; i-- > 0;)
      if (map_.get((*b)->data.span(), r * per + i) != 0) co_return r * per + i + 1;
  }
  co_return uint64_t{0};
}

}  // namespace qcowfs::image::qcow2
