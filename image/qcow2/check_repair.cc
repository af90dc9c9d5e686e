#include "image/qcow2/check_repair.h"

#include <algorithm>

#include "image/endian.h"
#include "image/qcow2/l2.h"
#include "image/qcow2/qcow2_inspect.h"
#include "image/qcow2/refcount.h"
#include "io/align.h"

namespace qcowfs::image::qcow2 {

// ---- StoredRefcounts ----

Task<Result<uint64_t>> StoredRefcounts::get(HostCluster hc) {
  auto block = co_await block_for(hc);
  if (!block) co_return block.status();
  if (*block == nullptr) co_return uint64_t{0};
  co_return map_.get((*block)->buf.span(), hc);
}

Task<Result<bool>> StoredRefcounts::set(HostCluster hc, uint64_t value) {
  auto block = co_await block_for(hc);
  if (!block) co_return block.status();
  if (*block == nullptr) co_return false;
  map_.set((*block)->buf.span(), hc, value);
  (*block)->dirty = true;
  co_return true;
}

Task<Status> StoredRefcounts::write_back() {
  for (auto& [host, block] : blocks_) {
    if (!block.dirty) continue;
    QCOWFS_CO_TRY(co_await file_.write(host, block.buf.span()));
    block.dirty = false;
  }
  co_return co_await file_.flush();
}

Task<Result<StoredRefcounts::Block*>> StoredRefcounts::block_for(HostCluster hc) {
  HostOffset host = map_.block_offset(table_, hc);
  if (host == 0) co_return static_cast<Block*>(nullptr);
  if (!is_aligned(host, map_.cluster_size()))
    co_return Status::errorf(EIO, "refcount block {:#x} is not cluster aligned", host);
  auto it = blocks_.find(host);
  if (it != blocks_.end()) co_return &it->second;
  io::AlignedBuffer buf(static_cast<size_t>(map_.cluster_size()), file_.mem_align());
  QCOWFS_CO_TRY(co_await read_padded(file_, host, buf.span()));
  co_return &blocks_.emplace(host, Block{std::move(buf), false}).first->second;
}

// ---- comparing refcounts ----

Task<Status> compare_refcounts(StoredRefcounts& stored, const std::vector<uint64_t>& counted, uint64_t nb_clusters,
                               bool fix_leaks, CheckReport& r, HostCluster& highest) {
  HostCluster end_hc = std::max<uint64_t>(nb_clusters, counted.size());
  for (HostCluster hc = 0; hc < end_hc; ++hc) {
    auto s = co_await stored.get(hc);
    if (!s) {
      r.messages.push_back(fmt::format("Can't get refcount for cluster {}: {}", hc, s.status().to_string()));
      ++r.check_errors;
      continue;
    }
    uint64_t want = hc < counted.size() ? counted[hc] : 0;
    if (*s > 0 || want > 0) highest = hc;
    if (*s == want) continue;
    bool leak = *s > want;
    if (leak && fix_leaks) {
      auto ok = co_await stored.set(hc, want);
      if (!ok) co_return ok.status();
      r.messages.push_back(fmt::format("Repairing cluster {} refcount={} reference={}", hc, *s, want));
      ++r.leaks_fixed;
      continue;
    }
    r.messages.push_back(fmt::format("{} cluster {} refcount={} reference={}", leak ? "Leaked" : "ERROR", hc, *s, want));
    if (leak) ++r.leaks;
    else ++r.corruptions;
  }
  if (fix_leaks) QCOWFS_CO_TRY(co_await stored.write_back());
  co_return Status::ok();
}

// ---- OFLAG_COPIED ----

namespace {

class CopiedChecker {
 public:
  CopiedChecker(io::HostFile& f, const Header& h, StoredRefcounts& stored, CheckReport& r, bool fix)
      : f_(f), h_(h), g_(make_geometry(h, f.size())), stored_(stored), r_(r), fix_(fix) {}

  Task<Status> run(std::vector<uint64_t> l1) {
    bool l1_dirty = false;
    for (size_t i = 0; i < l1.size(); ++i) {
      HostOffset l2 = l1[i] & kL1OffsetMask;
      if (l2 == 0) continue;
      auto rc = co_await stored_.get(l2 >> h_.cluster_bits);
      if (!rc) continue;
      if ((*rc == 1) != ((l1[i] & kOflagCopied) != 0)) l1_dirty |= fix_l1_entry(i, l1[i], *rc);
      if (is_aligned(l2, h_.cluster_size())) QCOWFS_CO_TRY(co_await check_l2(l2));
    }
    if (l1_dirty) QCOWFS_CO_TRY(co_await write_l1(l1));
    co_return Status::ok();
  }

 private:
  // Reports a wrong flag on L1 entry i; with fix_, corrects it (true).
  bool fix_l1_entry(size_t i, uint64_t& entry, uint64_t rc) {
    r_.messages.push_back(fmt::format("{} OFLAG_COPIED L2 cluster: l1_index={} l1_entry={:x} refcount={}",
                                      fix_ ? "Repairing" : "ERROR", i, entry, rc));
    if (!fix_) {
      ++r_.corruptions;
      return false;
    }
    entry = rc == 1 ? entry | kOflagCopied : entry & ~kOflagCopied;
    ++r_.corruptions_fixed;
    return true;
  }

  // The refcount of the host cluster a mapped L2 entry names (1 in a data file).
  Task<Result<uint64_t>> data_refcount(const L2EntryClass& c) {
    if (h_.has_external_data_file()) co_return uint64_t{1};
    co_return co_await stored_.get(c.host >> h_.cluster_bits);
  }

  Task<Status> check_l2(HostOffset l2) {
    io::AlignedBuffer buf(static_cast<size_t>(h_.cluster_size()), f_.mem_align());
    if (!co_await read_padded(f_, l2, buf.span())) co_return Status::ok();  // already counted by the walk
    bool dirty = false;
    size_t esize = g_.l2_entry_size();
    for (uint64_t i = 0; i < g_.l2_entries(); ++i) {
      std::byte* p = buf.data() + i * esize;
      L2EntryClass c = decode_l2_entry(g_, load_be64(p), 0);
      if (!c.mapped()) continue;  // only normal and ZERO_ALLOC clusters have a refcount to match
      auto rc = co_await data_refcount(c);
      if (!rc || (*rc == 1) == c.copied) continue;
      r_.messages.push_back(fmt::format("{} OFLAG_COPIED data cluster: l2_entry={:x} refcount={}",
                                        fix_ ? "Repairing" : "ERROR", c.entry, *rc));
      if (!fix_) {
        ++r_.corruptions;
        continue;
      }
      store_be64(p, *rc == 1 ? c.entry | kOflagCopied : c.entry & ~kOflagCopied);
      dirty = true;
      ++r_.corruptions_fixed;
    }
    if (dirty) QCOWFS_CO_TRY(co_await f_.write(l2, buf.span()));
    co_return Status::ok();
  }

  Task<Status> write_l1(const std::vector<uint64_t>& l1) {
    std::vector<std::byte> bytes(l1.size() * kL1EntrySize);
    for (size_t i = 0; i < l1.size(); ++i) store_be64(bytes.data() + i * kL1EntrySize, l1[i]);
    QCOWFS_CO_TRY(co_await f_.write(h_.l1_table_offset, bytes));
    co_return co_await f_.flush();
  }

  io::HostFile& f_;
  const Header& h_;
  const Geometry g_;
  StoredRefcounts& stored_;
  CheckReport& r_;
  bool fix_;
};

// Where a rebuilt refcount structure goes and how big it is: the blocks from
// first_hc, then the table; together they cover themselves.
struct RebuiltLayout {
  HostCluster first_hc = 0;
  uint64_t blocks = 0;
  uint64_t table_clusters = 0;
};

RebuiltLayout plan_rebuilt_layout(const RefcountMap& map, HostCluster first_free_hc) {
  RebuiltLayout l{first_free_hc, 0, 0};
  for (;;) {
    uint64_t blocks = map.blocks_for(first_free_hc + l.blocks + l.table_clusters);
    uint64_t table = map.table_clusters_for(blocks);
    if (blocks == l.blocks && table == l.table_clusters) return l;
    l.blocks = blocks;
    l.table_clusters = table;
  }
}

// Writes the blocks holding `counted` (which covers the new structure too) and
// returns the table naming them.
Task<Result<std::vector<uint64_t>>> write_rebuilt_blocks(io::HostFile& f, const RefcountMap& map,
                                                         const RebuiltLayout& l, const std::vector<uint64_t>& counted) {
  const uint64_t cs = map.cluster_size(), per = map.block_entries();
  std::vector<uint64_t> table;
  for (uint64_t b = 0; b < l.blocks; ++b) {
    io::AlignedBuffer block(static_cast<size_t>(cs), f.mem_align());
    for (HostCluster hc = b * per; hc < (b + 1) * per && hc < counted.size(); ++hc) {
      if (counted[hc] > map.max())
        co_return Status::errorf(EIO, "cluster {} has {} references, more than a refcount holds", hc, counted[hc]);
      map.set(block.span(), hc, counted[hc]);
    }
    HostOffset host = (l.first_hc + b) * cs;
    QCOWFS_CO_TRY(co_await f.write(host, block.span()));
    table.push_back(host);
  }
  co_return table;
}

}  // namespace

Task<Status> check_oflag_copied(io::HostFile& f, const Header& h, StoredRefcounts& stored, CheckReport& r, bool fix,
                                std::vector<uint64_t> active_l1) {
  CopiedChecker copied(f, h, stored, r, fix);
  co_return co_await copied.run(std::move(active_l1));
}

Task<Status> write_refcount_structure(io::HostFile& f, Header& h, std::vector<uint64_t> counted) {
  const uint64_t cs = h.cluster_size();
  const RefcountMap map(h.cluster_bits, h.refcount_order);
  RebuiltLayout l = plan_rebuilt_layout(map, std::max<uint64_t>(counted.size(), div_round_up(f.size(), cs)));
  HostCluster table_hc = l.first_hc + l.blocks;
  counted.resize(table_hc + l.table_clusters, 0);
  for (HostCluster hc = l.first_hc; hc < counted.size(); ++hc) counted[hc] = 1;
  if (l.table_clusters * cs > kMaxRefcountTableBytes)
    co_return Status::error(EFBIG, "rebuilt refcount table would exceed QEMU's size limit");
  auto table = co_await write_rebuilt_blocks(f, map, l, counted);
  if (!table) co_return table.status();
  io::AlignedBuffer bytes = serialize_reftable(*table, static_cast<size_t>(l.table_clusters * cs), f.mem_align());
  QCOWFS_CO_TRY(co_await f.write(table_hc * cs, bytes.span()));
  QCOWFS_CO_TRY(co_await f.flush());
  // One header write switches to the new structure.
  QCOWFS_CO_TRY(co_await write_reftable_location(f, table_hc * cs, static_cast<uint32_t>(l.table_clusters)));
  QCOWFS_CO_TRY(co_await f.flush());
  h.refcount_table_offset = table_hc * cs;
  h.refcount_table_clusters = static_cast<uint32_t>(l.table_clusters);
  co_return Status::ok();
}

}  // namespace qcowfs::image::qcow2
