#include "image/qcow2/refcount.h"

#include <algorithm>
#include <cstring>

#include "image/endian.h"
#include "image/qcow2/format.h"
#include "io/align.h"
#include "io/log.h"

namespace qcowfs::image::qcow2 {

RefcountTable::RefcountTable(io::HostFile& file, uint32_t cluster_bits, uint32_t refcount_order,
                             uint64_t table_offset, std::vector<uint64_t> table, size_t cache_blocks)
    : file_(file),
      cluster_bits_(cluster_bits),
      order_(refcount_order),
      table_offset_(table_offset),
      table_(std::move(table)),
      cache_blocks_(std::max<size_t>(cache_blocks, 4)) {}

Task<Result<std::unique_ptr<RefcountTable>>> RefcountTable::load(io::HostFile& file, uint32_t cluster_bits,
                                                                 uint32_t refcount_order, uint64_t table_offset,
                                                                 uint32_t table_clusters, size_t cache_blocks) {
  size_t bytes = size_t{table_clusters} << cluster_bits;
  io::AlignedBuffer buf(bytes, file.mem_align(), true);
  auto n = co_await file.read(buf.span(), table_offset);
  if (!n) co_return n.status().with_context("reading the refcount table");
  if (*n != bytes) co_return Status::errorf(EIO, "refcount table at {:#x} is truncated by the end of the file", table_offset);
  std::vector<uint64_t> table(bytes / 8);
  for (size_t i = 0; i < table.size(); ++i) {
    table[i] = load_be64(buf.data() + i * 8) & kReftableOffsetMask;
    if (table[i] != 0 && !is_aligned(table[i], uint64_t{1} << cluster_bits))
      co_return Status::errorf(EIO, "refcount block offset {:#x} (reftable entry {}) is not cluster aligned", table[i], i);
  }
  co_return std::make_unique<RefcountTable>(file, cluster_bits, refcount_order, table_offset, std::move(table),
                                            cache_blocks);
}

uint32_t RefcountTable::table_clusters() const {
  return static_cast<uint32_t>(div_round_up(table_.size() * 8, cluster_size()));
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
  auto n = co_await file_.read(b->data.span(), b->host_offset);
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

std::optional<uint64_t> RefcountTable::peek(uint64_t cluster) const {
  uint64_t index = cluster / block_entries();
  if (!has_block(index)) return uint64_t{0};
  auto b = cached(index);
  if (!b) return std::nullopt;
  return get_refcount_entry(b->data.span(), cluster % block_entries(), order_);
}

Task<Status> RefcountTable::load_block_for(uint64_t cluster) {
  uint64_t index = cluster / block_entries();
  if (!has_block(index) || cached(index)) co_return Status::ok();
  auto b = co_await block(index);
  if (!b) co_return b.status();
  co_return Status::ok();
}

Task<Result<uint64_t>> RefcountTable::get(uint64_t cluster) {
  uint64_t index = cluster / block_entries();
  if (!has_block(index)) co_return uint64_t{0};
  auto b = co_await block(index);
  if (!b) co_return b.status();
  co_return get_refcount_entry((*b)->data.span(), cluster % block_entries(), order_);
}

Task<Status> RefcountTable::add(uint64_t first, uint64_t n, int64_t delta) {
  const uint64_t per = block_entries();
  const uint64_t maxv = max_refcount(order_);
  // Check every entry first so that a failure changes nothing.
  for (uint64_t c = first; c < first + n; ++c) {
    uint64_t index = c / per;
    if (!has_block(index)) {
      corruption_found_ = true;
      co_return Status::errorf(EIO, "refcount update of cluster {:#x}: no refcount block covers it", c);
    }
    auto b = co_await block(index);
    if (!b) co_return b.status();
    uint64_t v = get_refcount_entry((*b)->data.span(), c % per, order_);
    bool bad = delta >= 0 ? maxv - v < static_cast<uint64_t>(delta) : v < static_cast<uint64_t>(-delta);
    if (bad) {
      corruption_found_ = true;
      log::error("refcount of host cluster {:#x} would leave [0, {}] ({} {:+})", c << cluster_bits_, maxv, v, delta);
      co_return Status::errorf(EIO, "refcount {} of host cluster {:#x} {} ", v, c << cluster_bits_,
                               delta >= 0 ? "overflows" : "underflows");
    }
  }
  for (uint64_t c = first; c < first + n; ++c) {
    auto b = co_await block(c / per);
    if (!b) co_return b.status();
    Block& blk = **b;
    uint64_t v = get_refcount_entry(blk.data.span(), c % per, order_);
    set_refcount_entry(blk.data.span(), c % per, order_, v + static_cast<uint64_t>(delta));
    ++blk.gen;
  }
  co_return Status::ok();
}

void RefcountTable::install_block(uint64_t index, uint64_t host_cluster) {
  auto b = std::make_shared<Block>();
  b->host_offset = host_cluster << cluster_bits_;
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
    QCOWFS_CO_TRY(co_await file_.write(b->data.span(), b->host_offset));
    b->written_gen = b->gen;
  }
  co_return Status::ok();
}

Task<Result<uint64_t>> RefcountTable::grow(uint64_t min_entries, uint64_t at) {
  const uint64_t cs = cluster_size(), per = block_entries();
  uint64_t entries = std::max<uint64_t>(min_entries, table_.size() + table_.size() / 2 + 1);
  uint64_t tc = 0;
  std::vector<uint64_t> missing;
  for (;;) {
    tc = div_round_up(entries * 8, cs);
    missing.clear();
    // The new table and blocks occupy [at, at + tc + missing.size()); every block
    // index that range touches must exist (new blocks cover themselves).
    for (size_t prev = SIZE_MAX; prev != missing.size();) {
      prev = missing.size();
      missing.clear();
      uint64_t end = at + tc + prev;
      for (uint64_t r = at / per; r <= (end - 1) / per; ++r)
        if (!has_block(r)) missing.push_back(r);
    }
    uint64_t last_index = (at + tc + missing.size() - 1) / per;
    if (last_index < tc * cs / 8) break;
    entries = last_index + 1;
  }
  if (tc * cs > kMaxRefcountTableBytes)
    co_return Status::errorf(EFBIG, "refcount table would exceed {} bytes", kMaxRefcountTableBytes);
  std::vector<uint64_t> old_table = table_;
  uint64_t old_offset = table_offset();
  uint32_t old_clusters = table_clusters();
  table_.resize(tc * cs / 8, 0);
  uint64_t c = at + tc;
  for (uint64_t r : missing) install_block(r, c++);
  Status st = co_await add(at, c - at, +1);
  if (st) st = co_await write_blocks_now();
  if (st) {
    io::AlignedBuffer buf(static_cast<size_t>(tc * cs), file_.mem_align(), true);
    for (size_t i = 0; i < table_.size(); ++i) store_be64(buf.data() + i * 8, table_[i]);
    st = co_await file_.write(buf.span(), at * cs);
  }
  if (st) st = co_await file_.flush();
  if (st) {
    // refcount_table_offset and refcount_table_clusters are adjacent: one write.
    std::byte hdr[12];
    store_be64(hdr, at * cs);
    store_be32(hdr + 8, static_cast<uint32_t>(tc));
    st = co_await file_.write(std::span<const std::byte>(hdr, sizeof hdr), 48);
  }
  if (st) st = co_await file_.flush();
  if (!st) {
    // The header still names the old table: forget the new one. Blocks already
    // written stay valid (they only count clusters nothing references yet).
    for (uint64_t r : missing) blocks_.erase(r);
    table_ = std::move(old_table);
    for (uint64_t r : missing) dirty_table_.erase(r);
    co_return st;
  }
  table_offset_.store(at * cs, std::memory_order_release);
  dirty_table_.clear();
  log::debug("refcount table grown to {} clusters at {:#x}", tc, at * cs);
  QCOWFS_CO_TRY(co_await add(old_offset / cs, old_clusters, -1));
  co_return c;
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

Task<Result<uint64_t>> RefcountTable::end_of_used() {
  const uint64_t per = block_entries();
  for (uint64_t r = table_.size(); r-- > 0;) {
    if (!has_block(r)) continue;
    auto b = co_await block(r);
    if (!b) co_return b.status();
    for (uint64_t i = per; i-- > 0;)
      if (get_refcount_entry((*b)->data.span(), i, order_) != 0) co_return r * per + i + 1;
  }
  co_return uint64_t{0};
}

}  // namespace qcowfs::image::qcow2
