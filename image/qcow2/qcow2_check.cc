#include "image/qcow2/qcow2_check.h"

#include <algorithm>
#include <cstring>
#include <map>

#include "image/endian.h"
#include "image/qcow2/qcow2_inspect.h"
#include "image/qcow2/l2.h"
#include "io/align.h"

namespace qcowfs::image::qcow2 {
namespace {

// How an L2 entry reads, as QEMU's qcow2_get_cluster_type() classifies it.
enum class ClusterType { unallocated, zero_plain, zero_alloc, normal, compressed };

ClusterType cluster_type(const Header& h, uint64_t entry) {
  if (entry & kOflagCompressed) return ClusterType::compressed;
  uint64_t offset = entry & kL2OffsetMask;
  if ((entry & kOflagZero) && !h.extended_l2()) return offset ? ClusterType::zero_alloc : ClusterType::zero_plain;
  if (offset != 0) return ClusterType::normal;
  // Offset 0 is a valid data file offset; OFLAG_COPIED (refcount 1, always
  // true in data files) tells it from an unallocated entry.
  if (h.has_external_data_file() && (entry & kOflagCopied)) return ClusterType::normal;
  return ClusterType::unallocated;
}

// Refcount blocks of the image as stored, read on demand and written back
// when changed (leak repair).
class StoredRefcounts {
 public:
  StoredRefcounts(io::HostFile& file, const Header& h, std::vector<uint64_t> table)
      : file_(file), h_(h), table_(std::move(table)) {}

  uint64_t entries_per_block() const { return (h_.cluster_size() * 8) >> h_.refcount_order; }
  const std::vector<uint64_t>& table() const { return table_; }

  // The stored refcount of a cluster; 0 beyond the table or in an absent block.
  Task<Result<uint64_t>> get(uint64_t cluster) {
    auto block = co_await block_for(cluster);
    if (!block) co_return block.status();
    if (*block == nullptr) co_return uint64_t{0};
    co_return get_refcount_entry((*block)->buf.span(), cluster % entries_per_block(), h_.refcount_order);
  }

  // Sets a stored refcount in place; false when no block covers the cluster.
  Task<Result<bool>> set(uint64_t cluster, uint64_t value) {
    auto block = co_await block_for(cluster);
    if (!block) co_return block.status();
    if (*block == nullptr) co_return false;
    set_refcount_entry((*block)->buf.span(), cluster % entries_per_block(), h_.refcount_order, value);
    (*block)->dirty = true;
    co_return true;
  }

  Task<Status> write_back() {
    for (auto& [offset, block] : blocks_) {
      if (!block.dirty) continue;
      QCOWFS_CO_TRY(co_await file_.write(block.buf.span(), offset));
      block.dirty = false;
    }
    co_return co_await file_.flush();
  }

 private:
  struct Block {
    io::AlignedBuffer buf;
    bool dirty = false;
  };

  Task<Result<Block*>> block_for(uint64_t cluster) {
    uint64_t index = cluster / entries_per_block();
    if (index >= table_.size()) co_return static_cast<Block*>(nullptr);
    uint64_t offset = table_[index] & kReftableOffsetMask;
    if (offset == 0) co_return static_cast<Block*>(nullptr);
    if (!is_aligned(offset, h_.cluster_size()))
      co_return Status::errorf(EIO, "refcount block {:#x} is not cluster aligned", offset);
    auto it = blocks_.find(offset);
    if (it != blocks_.end()) co_return &it->second;
    auto buf = co_await read_padded(file_, offset, static_cast<size_t>(h_.cluster_size()));
    if (!buf) co_return buf.status();
    co_return &blocks_.emplace(offset, Block{std::move(*buf), false}).first->second;
  }

  io::HostFile& file_;
  const Header& h_;
  std::vector<uint64_t> table_;
  std::map<uint64_t, Block> blocks_;
};

// One pass over the metadata counting references per cluster (QEMU's
// calculate_refcounts()), recording problems in the report as it goes.
class Walker {
 public:
  Walker(io::HostFile& file, const Header& h, CheckReport& r, const CheckOptions& opts)
      : file_(file), h_(h), cs_(h.cluster_size()), r_(r), opts_(opts) {
    counted_.resize(div_round_up(file.size(), cs_));
  }

  std::vector<uint64_t>& counted() { return counted_; }
  bool rebuild_needed() const { return rebuild_; }

  // Everything but the refcount structures.
  Task<Status> count_metadata(const std::vector<Snapshot>& snapshots, uint64_t snapshot_table_bytes) {
    total_l2_ = count_l2_tables(snapshots);
    inc(0, cs_);
    QCOWFS_CO_TRY(co_await walk_l1(h_.l1_table_offset, h_.l1_size, true));
    if (h_.has_external_data_file() && !snapshots.empty()) {
      note("ERROR {} snapshots in image with data file", snapshots.size());
      ++r_.corruptions;
    }
    for (const Snapshot& s : snapshots) {
      if (!is_aligned(s.l1_table_offset, cs_)) {
        note("ERROR snapshot {} ({}) l1_offset={:#x}: L1 table is not cluster aligned; snapshot table entry corrupted",
             s.id, s.name, s.l1_table_offset);
        ++r_.corruptions;
        continue;
      }
      QCOWFS_CO_TRY(co_await walk_l1(s.l1_table_offset, s.l1_size, false));
    }
    inc(h_.snapshots_offset, snapshot_table_bytes);
    if (h_.crypto) inc(h_.crypto->offset, h_.crypto->length);
    if (opts_.progress) opts_.progress(total_l2_ * cs_, total_l2_ * cs_);
    co_return co_await count_bitmaps();
  }

  // The refcount table and blocks (QEMU's check_refblocks()).
  void count_refcount_structures(const std::vector<uint64_t>& reftable) {
    inc(h_.refcount_table_offset, uint64_t{h_.refcount_table_clusters} * cs_);
    uint64_t nb_clusters = div_round_up(file_.size(), cs_);
    for (size_t i = 0; i < reftable.size(); ++i) {
      uint64_t offset = reftable[i] & kReftableOffsetMask;
      uint64_t cluster = offset / cs_;
      if (reftable[i] & ~kReftableOffsetMask) {
        note("ERROR refcount table entry {} has reserved bits set", i);
        corrupt_structure();
      } else if (!is_aligned(offset, cs_)) {
        note("ERROR refcount block {} is not cluster aligned; refcount table entry corrupted", i);
        corrupt_structure();
      } else if (offset != 0 && cluster >= nb_clusters) {
        note("ERROR refcount block {} is outside image", i);
        corrupt_structure();
      } else if (offset != 0) {
        inc(offset, cs_);
        if (counted_[cluster] != 1) {
          note("ERROR refcount block {} refcount={}", i, counted_[cluster]);
          corrupt_structure();
        }
      }
    }
  }

  // L1 entries of the active table, for the OFLAG_COPIED pass.
  const std::vector<uint64_t>& active_l1() const { return active_l1_; }

 private:
  template <typename... Args>
  void note(fmt::format_string<Args...> f, Args&&... args) {
    r_.messages.push_back(fmt::format(f, std::forward<Args>(args)...));
  }

  void corrupt_structure() {
    ++r_.corruptions;
    rebuild_ = true;
  }

  uint64_t count_l2_tables(const std::vector<Snapshot>& snapshots) const {
    uint64_t n = h_.l1_size;
    for (const Snapshot& s : snapshots) n += s.l1_size;
    return n;
  }

  // Counts one reference to every cluster of [offset, offset+size) (QEMU's
  // qcow2_inc_refcounts_imrt()). A region reaching a cluster or more past the
  // end of the file is a corruption and is not counted.
  void inc(uint64_t offset, uint64_t size) {
    if (size == 0) return;
    uint64_t file_len = file_.size();
    if (offset + size >= file_len && offset + size - file_len >= cs_) {
      note("ERROR: counting reference for region exceeding the end of the file by one cluster or more: "
           "offset {:#x} size {:#x}", offset, size);
      ++r_.corruptions;
      return;
    }
    uint64_t max = max_refcount(h_.refcount_order);
    for (uint64_t c = offset / cs_; c <= (offset + size - 1) / cs_; ++c) {
      if (c >= counted_.size()) counted_.resize(c + 1);
      if (counted_[c] == max) {
        note("ERROR: overflow cluster offset={:#x}", c * cs_);
        ++r_.corruptions;
        continue;
      }
      ++counted_[c];
    }
  }

  Task<Status> walk_l1(uint64_t l1_offset, uint32_t l1_size, bool active) {
    if (l1_size == 0) co_return Status::ok();
    inc(l1_offset, uint64_t{l1_size} * 8);
    auto buf = co_await read_padded(file_, l1_offset, size_t{l1_size} * 8);
    if (!buf) {
      note("ERROR: I/O error in check_refcounts_l1: {}", buf.status().to_string());
      ++r_.check_errors;
      co_return Status::ok();
    }
    for (uint32_t i = 0; i < l1_size; ++i) {
      uint64_t entry = load_be64(buf->data() + size_t{i} * 8);
      if (active) active_l1_.push_back(entry);
      if (entry == 0) {
        report_progress();
        continue;
      }
      uint64_t l2_offset = entry & kL1OffsetMask;
      inc(l2_offset, cs_);
      if (!is_aligned(l2_offset, cs_)) {
        note("ERROR l2_offset={:#x}: Table is not cluster aligned; L1 entry corrupted", l2_offset);
        ++r_.corruptions;
      }
      QCOWFS_CO_TRY(co_await walk_l2(l2_offset, active));
      report_progress();
    }
    co_return Status::ok();
  }

  void report_progress() {
    ++done_l2_;
    if (opts_.progress && done_l2_ % 64 == 0 && done_l2_ < total_l2_) opts_.progress(done_l2_ * cs_, total_l2_ * cs_);
  }

  Task<Status> walk_l2(uint64_t l2_offset, bool active) {
    auto buf = co_await read_padded(file_, l2_offset, static_cast<size_t>(cs_));
    if (!buf) {
      note("ERROR: I/O error in check_refcounts_l2: {}", buf.status().to_string());
      ++r_.check_errors;
      co_return Status::ok();
    }
    next_contiguous_ = 0;  // fragmentation is counted within each L2 table, as QEMU does
    size_t esize = h_.l2_entry_size();
    for (uint64_t i = 0; i < h_.l2_entries(); ++i) {
      const std::byte* p = buf->data() + i * esize;
      uint64_t entry = load_be64(p);
      uint64_t bitmap = h_.extended_l2() ? load_be64(p + 8) : 0;
      check_l2_entry(entry, bitmap, active);
    }
    co_return Status::ok();
  }

  void check_l2_entry(uint64_t entry, uint64_t bitmap, bool active) {
    switch (cluster_type(h_, entry)) {
      case ClusterType::compressed: return count_compressed(entry, bitmap, active);
      case ClusterType::zero_alloc:
      case ClusterType::normal: return count_data(entry, bitmap, active);
      case ClusterType::zero_plain: return;
      case ClusterType::unallocated:
        if (bitmap & kSubclusterAllocMask) {
          note("ERROR: Unallocated cluster has non-zero subcluster allocation bitmap");
          ++r_.corruptions;
        }
        return;
    }
  }

  void count_compressed(uint64_t entry, uint64_t bitmap, bool active) {
    if (entry & kOflagCopied) {
      note("ERROR: coffset={:#x}: copied flag must never be set for compressed clusters",
           entry & compressed_offset_mask(h_.cluster_bits));
      ++r_.corruptions;
    }
    if (h_.has_external_data_file()) {
      note("ERROR compressed cluster with data file");
      ++r_.corruptions;
      return;
    }
    if (bitmap != 0) {
      note("ERROR compressed cluster {:#x} has a non-zero subcluster bitmap", entry);
      ++r_.corruptions;
    }
    CompressedCluster c = decode_compressed(h_.cluster_bits, entry);
    inc(c.host_offset, c.size);
    if (active) {
      ++r_.allocated_clusters;
      ++r_.compressed_clusters;
      ++r_.fragmented_clusters;
    }
  }

  void count_data(uint64_t entry, uint64_t bitmap, bool active) {
    uint64_t offset = entry & kL2OffsetMask;
    if ((bitmap >> kSubclusterZeroShift) & bitmap) {
      note("ERROR offset={:#x}: Allocated cluster has corrupted subcluster allocation bitmap", offset);
      ++r_.corruptions;
    }
    if (!is_aligned(offset, cs_)) {
      note("ERROR offset={:#x}: Data cluster is not properly aligned; L2 entry corrupted", offset);
      ++r_.corruptions;
    }
    if (active) {
      ++r_.allocated_clusters;
      if (next_contiguous_ != 0 && offset != next_contiguous_) ++r_.fragmented_clusters;
      next_contiguous_ = offset + cs_;
    }
    if (!h_.has_external_data_file()) inc(offset, cs_);
  }

  Task<Status> count_bitmaps() {
    if (!h_.bitmaps || !(h_.autoclear_features & kAutoclearBitmaps)) co_return Status::ok();
    inc(h_.bitmaps->directory_offset, h_.bitmaps->directory_size);
    auto bitmaps = co_await read_qcow2_bitmaps(file_, h_);
    if (!bitmaps) {
      note("ERROR bitmap directory: {}", bitmaps.status().to_string());
      ++r_.corruptions;
      co_return Status::ok();
    }
    for (const Bitmap& b : *bitmaps) {
      auto ranges = co_await bitmap_ranges(file_, h_, b);
      if (!ranges) {
        ++r_.check_errors;
        continue;
      }
      for (const HostRange& r : *ranges) inc(r.offset, r.length);
    }
    co_return Status::ok();
  }

  io::HostFile& file_;
  const Header& h_;
  uint64_t cs_;
  CheckReport& r_;
  const CheckOptions& opts_;
  std::vector<uint64_t> counted_;
  std::vector<uint64_t> active_l1_;
  uint64_t next_contiguous_ = 0;
  uint64_t total_l2_ = 0;
  uint64_t done_l2_ = 0;
  bool rebuild_ = false;
};

Task<Result<std::vector<uint64_t>>> read_reftable(io::HostFile& f, const Header& h) {
  uint64_t bytes = uint64_t{h.refcount_table_clusters} * h.cluster_size();
  auto buf = co_await read_padded(f, h.refcount_table_offset, static_cast<size_t>(bytes));
  if (!buf) co_return buf.status();
  std::vector<uint64_t> t(bytes / 8);
  for (size_t i = 0; i < t.size(); ++i) t[i] = load_be64(buf->data() + i * 8);
  co_return t;
}

// The walk of everything, refcount structures included or not.
struct Counts {
  std::vector<uint64_t> counted;
  std::vector<uint64_t> active_l1;
  bool rebuild_needed = false;
};

Task<Result<Counts>> count_references(io::HostFile& f, const Header& h, CheckReport& r, const CheckOptions& opts,
                                      const std::vector<uint64_t>* reftable) {
  auto sn = co_await read_qcow2_snapshots(f, h);
  if (!sn) co_return sn.status();
  Walker w(f, h, r, opts);
  QCOWFS_CO_TRY(co_await w.count_metadata(sn->snapshots, sn->table_bytes));
  if (reftable) w.count_refcount_structures(*reftable);
  co_return Counts{std::move(w.counted()), w.active_l1(), w.rebuild_needed()};
}

// Compares stored and counted refcounts (QEMU's compare_refcounts()); with
// fix_leaks, leaked refcounts are lowered in place.
Task<Status> compare_refcounts(StoredRefcounts& stored, const std::vector<uint64_t>& counted, uint64_t nb_clusters,
                               bool fix_leaks, CheckReport& r, uint64_t& highest) {
  uint64_t end = std::max<uint64_t>(nb_clusters, counted.size());
  for (uint64_t i = 0; i < end; ++i) {
    auto s = co_await stored.get(i);
    if (!s) {
      r.messages.push_back(fmt::format("Can't get refcount for cluster {}: {}", i, s.status().to_string()));
      ++r.check_errors;
      continue;
    }
    uint64_t want = i < counted.size() ? counted[i] : 0;
    if (*s > 0 || want > 0) highest = i;
    if (*s == want) continue;
    bool leak = *s > want;
    if (leak && fix_leaks) {
      auto ok = co_await stored.set(i, want);
      if (!ok) co_return ok.status();
      r.messages.push_back(fmt::format("Repairing cluster {} refcount={} reference={}", i, *s, want));
      ++r.leaks_fixed;
      continue;
    }
    r.messages.push_back(fmt::format("{} cluster {} refcount={} reference={}", leak ? "Leaked" : "ERROR", i, *s, want));
    if (leak) ++r.leaks;
    else ++r.corruptions;
  }
  if (fix_leaks) QCOWFS_CO_TRY(co_await stored.write_back());
  co_return Status::ok();
}

// OFLAG_COPIED must be set exactly when the refcount is 1 (QEMU's
// check_oflag_copied()); with fix, wrong flags are corrected in place.
class CopiedChecker {
 public:
  CopiedChecker(io::HostFile& f, const Header& h, StoredRefcounts& stored, CheckReport& r, bool fix)
      : f_(f), h_(h), stored_(stored), r_(r), fix_(fix) {}

  Task<Status> run(std::vector<uint64_t> l1) {
    bool l1_dirty = false;
    for (size_t i = 0; i < l1.size(); ++i) {
      uint64_t l2_offset = l1[i] & kL1OffsetMask;
      if (l2_offset == 0) continue;
      auto rc = co_await stored_.get(l2_offset >> h_.cluster_bits);
      if (!rc) continue;
      if ((*rc == 1) != ((l1[i] & kOflagCopied) != 0)) {
        r_.messages.push_back(fmt::format("{} OFLAG_COPIED L2 cluster: l1_index={} l1_entry={:x} refcount={}",
                                          fix_ ? "Repairing" : "ERROR", i, l1[i], *rc));
        if (fix_) {
          l1[i] = *rc == 1 ? l1[i] | kOflagCopied : l1[i] & ~kOflagCopied;
          l1_dirty = true;
          ++r_.corruptions_fixed;
        } else {
          ++r_.corruptions;
        }
      }
      if (is_aligned(l2_offset, h_.cluster_size())) QCOWFS_CO_TRY(co_await check_l2(l2_offset));
    }
    if (l1_dirty) QCOWFS_CO_TRY(co_await write_l1(l1));
    co_return Status::ok();
  }

 private:
  Task<Status> check_l2(uint64_t l2_offset) {
    auto buf = co_await read_padded(f_, l2_offset, static_cast<size_t>(h_.cluster_size()));
    if (!buf) co_return Status::ok();  // already counted as a check error by the walk
    bool dirty = false;
    size_t esize = h_.l2_entry_size();
    for (uint64_t i = 0; i < h_.l2_entries(); ++i) {
      std::byte* p = buf->data() + i * esize;
      uint64_t entry = load_be64(p);
      ClusterType t = cluster_type(h_, entry);
      if (t != ClusterType::normal && t != ClusterType::zero_alloc) continue;
      uint64_t rc = 1;
      if (!h_.has_external_data_file()) {
        auto s = co_await stored_.get((entry & kL2OffsetMask) >> h_.cluster_bits);
        if (!s) continue;
        rc = *s;
      }
      if ((rc == 1) == ((entry & kOflagCopied) != 0)) continue;
      r_.messages.push_back(fmt::format("{} OFLAG_COPIED data cluster: l2_entry={:x} refcount={}",
                                        fix_ ? "Repairing" : "ERROR", entry, rc));
      if (!fix_) {
        ++r_.corruptions;
        continue;
      }
      store_be64(p, rc == 1 ? entry | kOflagCopied : entry & ~kOflagCopied);
      dirty = true;
      ++r_.corruptions_fixed;
    }
    if (dirty) QCOWFS_CO_TRY(co_await f_.write(buf->span(), l2_offset));
    co_return Status::ok();
  }

  Task<Status> write_l1(const std::vector<uint64_t>& l1) {
    std::vector<std::byte> bytes(l1.size() * 8);
    for (size_t i = 0; i < l1.size(); ++i) store_be64(bytes.data() + i * 8, l1[i]);
    QCOWFS_CO_TRY(co_await f_.write(bytes, h_.l1_table_offset));
    co_return co_await f_.flush();
  }

  io::HostFile& f_;
  const Header& h_;
  StoredRefcounts& stored_;
  CheckReport& r_;
  bool fix_;
};

// Where a rebuilt refcount structure goes and how big it is.
struct RefcountLayout {
  uint64_t first_cluster = 0;  // refcount blocks, then the table
  uint64_t blocks = 0;
  uint64_t table_clusters = 0;
};

RefcountLayout plan_refcount_layout(const Header& h, uint64_t first_free) {
  uint64_t per_block = (h.cluster_size() * 8) >> h.refcount_order;
  RefcountLayout l{first_free, 0, 0};
  for (;;) {
    uint64_t covered = first_free + l.blocks + l.table_clusters;
    uint64_t blocks = div_round_up(covered, per_block);
    uint64_t table = div_round_up(blocks * 8, h.cluster_size());
    if (blocks == l.blocks && table == l.table_clusters) return l;
    l.blocks = blocks;
    l.table_clusters = table;
  }
}

Task<Status> write_refcount_structure(io::HostFile& f, Header& h, std::vector<uint64_t> counted) {
  uint64_t cs = h.cluster_size();
  uint64_t first_free = std::max<uint64_t>(counted.size(), div_round_up(f.size(), cs));
  RefcountLayout l = plan_refcount_layout(h, first_free);
  uint64_t table_cluster = l.first_cluster + l.blocks;
  counted.resize(table_cluster + l.table_clusters, 0);
  for (uint64_t c = l.first_cluster; c < counted.size(); ++c) counted[c] = 1;
  if (l.table_clusters * cs > kMaxRefcountTableBytes)
    co_return Status::error(EFBIG, "rebuilt refcount table would exceed QEMU's size limit");
  uint64_t per_block = (cs * 8) >> h.refcount_order;
  uint64_t max = max_refcount(h.refcount_order);
  io::AlignedBuffer table(static_cast<size_t>(l.table_clusters * cs), f.mem_align());
  for (uint64_t b = 0; b < l.blocks; ++b) {
    io::AlignedBuffer block(static_cast<size_t>(cs), f.mem_align());
    for (uint64_t i = 0; i < per_block && b * per_block + i < counted.size(); ++i) {
      uint64_t v = counted[b * per_block + i];
      if (v > max) co_return Status::errorf(EIO, "cluster {} has {} references, more than a refcount holds", b * per_block + i, v);
      set_refcount_entry(block.span(), i, h.refcount_order, v);
    }
    uint64_t offset = (l.first_cluster + b) * cs;
    QCOWFS_CO_TRY(co_await f.write(block.span(), offset));
    store_be64(table.data() + b * 8, offset);
  }
  QCOWFS_CO_TRY(co_await f.write(table.span(), table_cluster * cs));
  QCOWFS_CO_TRY(co_await f.flush());
  // One header write switches to the new structure: refcount_table_offset and
  // refcount_table_clusters are adjacent.
  std::byte fields[12];
  store_be64(fields, table_cluster * cs);
  store_be32(fields + 8, static_cast<uint32_t>(l.table_clusters));
  static_assert(offsetof(HeaderLayout, refcount_table_clusters) == offsetof(HeaderLayout, refcount_table_offset) + 8);
  QCOWFS_CO_TRY(co_await f.write(fields, offsetof(HeaderLayout, refcount_table_offset)));
  QCOWFS_CO_TRY(co_await f.flush());
  h.refcount_table_offset = table_cluster * cs;
  h.refcount_table_clusters = static_cast<uint32_t>(l.table_clusters);
  co_return Status::ok();
}

// Clears the dirty and corrupt bits after a successful repair (v3 only).
Task<Status> mark_clean(io::HostFile& f, Header& h) {
  uint64_t bits = kIncompatDirty | kIncompatCorrupt;
  if (h.version < 3 || !(h.incompatible_features & bits)) co_return Status::ok();
  h.incompatible_features &= ~bits;
  std::byte field[8];
  store_be64(field, h.incompatible_features);
  QCOWFS_CO_TRY(co_await f.write(field, offsetof(HeaderLayout, incompatible_features)));
  co_return co_await f.flush();
}

// One check pass; with a repair mode, repairs as it goes.
Task<Result<CheckReport>> check_pass(io::HostFile& f, Header& h, const CheckOptions& opts) {
  CheckReport r;
  r.total_clusters = div_round_up(h.size, h.cluster_size());
  uint64_t nb_clusters = div_round_up(f.size(), h.cluster_size());
  auto reftable = co_await read_reftable(f, h);
  if (!reftable) co_return reftable.status();
  auto counts = co_await count_references(f, h, r, opts, &*reftable);
  if (!counts) co_return counts.status();
  StoredRefcounts stored(f, h, std::move(*reftable));
  uint64_t highest = 0;
  CheckReport compared = r;
  QCOWFS_CO_TRY(co_await compare_refcounts(stored, counts->counted, nb_clusters, false, compared, highest));
  bool need_rebuild = counts->rebuild_needed || compared.corruptions > r.corruptions;
  if (opts.repair == RepairMode::all && need_rebuild) {
    QCOWFS_CO_TRY(co_await rebuild_refcounts(f, h));
    compared.messages.push_back("Rebuilding refcount structure");
    r = compared;
    r.corruptions_fixed = r.corruptions;
    r.leaks_fixed = r.leaks;
    r.corruptions = r.leaks = 0;
    auto new_table = co_await read_reftable(f, h);
    if (!new_table) co_return new_table.status();
    StoredRefcounts rebuilt(f, h, std::move(*new_table));
    CopiedChecker copied(f, h, rebuilt, r, true);
    QCOWFS_CO_TRY(co_await copied.run(counts->active_l1));
    co_return r;
  }
  if (opts.repair != RepairMode::none && counts->rebuild_needed) {
    compared.messages.push_back("ERROR need to rebuild refcount structures (use -r all)");
    ++compared.check_errors;
  }
  if (opts.repair != RepairMode::none && compared.leaks > 0 && compared.check_errors == 0) {
    compared = r;
    highest = 0;
    QCOWFS_CO_TRY(co_await compare_refcounts(stored, counts->counted, nb_clusters, true, compared, highest));
  }
  r = std::move(compared);
  CopiedChecker copied(f, h, stored, r, opts.repair != RepairMode::none);  // as qemu: any -r
  QCOWFS_CO_TRY(co_await copied.run(counts->active_l1));
  r.image_end_offset = (highest + 1) * h.cluster_size();
  co_return r;
}

bool repaired_something(const CheckReport& r) { return r.leaks_fixed > 0 || r.corruptions_fixed > 0; }

}  // namespace

Task<Status> rebuild_refcounts(io::HostFile& file, Header& h, OnCorruption on_corruption) {
  CheckReport scratch;
  CheckOptions none;
  auto counts = co_await count_references(file, h, scratch, none, nullptr);
  if (!counts) co_return counts.status();
  if (scratch.check_errors > 0)
    co_return Status::errorf(EIO, "cannot rebuild refcounts of {}: metadata could not be read", file.path());
  if (scratch.corruptions > 0 && on_corruption == OnCorruption::refuse)
    co_return Status::errorf(EIO, "cannot rebuild refcounts of {}: corrupt metadata ({}); repair it with qcowfs check -r all",
                             file.path(), scratch.messages.empty() ? "" : scratch.messages.front());
  co_return co_await write_refcount_structure(file, h, std::move(counts->counted));
}

Task<Result<std::vector<HostRange>>> bitmap_ranges(io::HostFile& file, const Header& h, const Bitmap& b) {
  std::vector<HostRange> out;
  if (b.table_size == 0) co_return out;
  out.push_back(HostRange{b.table_offset, uint64_t{b.table_size} * 8});
  auto buf = co_await read_padded(file, b.table_offset, size_t{b.table_size} * 8);
  if (!buf) co_return buf.status().with_context(fmt::format("reading the table of bitmap '{}'", b.name));
  for (uint32_t i = 0; i < b.table_size; ++i) {
    uint64_t offset = load_be64(buf->data() + size_t{i} * 8) & kBitmapTableOffsetMask;
    if (offset != 0) out.push_back(HostRange{offset, h.cluster_size()});
  }
  co_return out;
}

Task<Result<std::vector<HostRange>>> bitmaps_extension_ranges(io::HostFile& file, const Header& h) {
  std::vector<HostRange> out;
  if (!h.bitmaps || !(h.autoclear_features & kAutoclearBitmaps)) co_return out;
  out.push_back(HostRange{h.bitmaps->directory_offset, h.bitmaps->directory_size});
  auto bitmaps = co_await read_qcow2_bitmaps(file, h);
  if (!bitmaps) co_return bitmaps.status().with_context("reading the bitmap directory");
  for (const Bitmap& b : *bitmaps) {
    auto ranges = co_await bitmap_ranges(file, h, b);
    if (!ranges) co_return ranges.status();
    out.insert(out.end(), ranges->begin(), ranges->end());
  }
  co_return out;
}

Task<Result<CheckReport>> check_image(io::HostFile& file, CheckOptions opts) {
  auto h = co_await read_qcow2_header(file);
  if (!h) co_return h.status();
  if (opts.repair != RepairMode::none && !file.writable())
    co_return Status::error(EROFS, "repairing needs the image opened read-write");
  auto first = co_await check_pass(file, *h, opts);
  if (!first || opts.repair == RepairMode::none) co_return first;
  if (!repaired_something(*first) && first->corruptions == 0 && first->leaks == 0 && first->check_errors == 0) {
    QCOWFS_CO_TRY(co_await mark_clean(file, *h));
    co_return first;
  }
  // Double check the repaired image, as qemu-img does, and report that.
  CheckOptions again;
  auto second = co_await check_pass(file, *h, again);
  if (!second) co_return second.status();
  second->leaks_fixed = first->leaks_fixed;
  second->corruptions_fixed = first->corruptions_fixed;
  std::vector<std::string> messages = std::move(first->messages);
  if (repaired_something(*first)) messages.push_back("Double checking the fixed image now...");
  messages.insert(messages.end(), second->messages.begin(), second->messages.end());
  second->messages = std::move(messages);
  if (second->corruptions == 0 && second->check_errors == 0) QCOWFS_CO_TRY(co_await mark_clean(file, *h));
  co_return second;
}

}  // namespace qcowfs::image::qcow2
