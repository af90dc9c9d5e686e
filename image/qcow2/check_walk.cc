#include "image/qcow2/check_walk.h"

#include "image/endian.h"
#include "image/qcow2/l2.h"
#include "image/qcow2/qcow2_inspect.h"
#include "io/align.h"

namespace qcowfs::image::qcow2 {
namespace {

// One pass over the metadata counting references per host cluster (QEMU's
// calculate_refcounts()), recording problems in the report as it goes.
class Walker {
 public:
  Walker(io::HostFile& file, const Header& h, CheckReport& r, const CheckOptions& opts)
      : file_(file), h_(h), g_(make_geometry(h, file.size())), cs_(h.cluster_size()), r_(r), opts_(opts) {
    counted_.resize(div_round_up(file.size(), cs_));
  }

  std::vector<uint64_t>& counted() { return counted_; }
  bool rebuild_needed() const { return rebuild_; }
  // L1 entries of the active table, for the OFLAG_COPIED pass.
  const std::vector<uint64_t>& active_l1() const { return active_l1_; }

  // Everything but the refcount structures.
  Task<Status> count_metadata(const std::vector<Snapshot>& snapshots, uint64_t snapshot_table_bytes) {
    total_l2_ = count_l2_tables(snapshots);
    inc(0, cs_);
    QCOWFS_CO_TRY(co_await walk_l1(h_.l1_table_offset, h_.l1_size, true));
    QCOWFS_CO_TRY(co_await walk_snapshots(snapshots));
    inc(h_.snapshots_offset, snapshot_table_bytes);
    if (h_.crypto) inc(h_.crypto->offset, h_.crypto->length);
    if (opts_.progress) opts_.progress(total_l2_ * cs_, total_l2_ * cs_);
    co_return co_await count_bitmaps();
  }

  // The refcount table and blocks (QEMU's check_refblocks()).
  void count_refcount_structures(const std::vector<uint64_t>& reftable) {
    inc(h_.refcount_table_offset, uint64_t{h_.refcount_table_clusters} * cs_);
    for (size_t i = 0; i < reftable.size(); ++i) count_refcount_block(i, reftable[i]);
  }

 private:
  template <typename... Args>
  void note(fmt::format_string<Args...> f, Args&&... args) {
    r_.messages.push_back(fmt::format(f, std::forward<Args>(args)...));
  }

  template <typename... Args>
  void corruption(fmt::format_string<Args...> f, Args&&... args) {
    note(f, std::forward<Args>(args)...);
    ++r_.corruptions;
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

  void count_refcount_block(size_t i, uint64_t reftable_entry) {
    HostOffset host = reftable_entry & kReftableOffsetMask;
    HostCluster hc = host / cs_;
    if (reftable_entry & ~kReftableOffsetMask) {
      note("ERROR refcount table entry {} has reserved bits set", i);
      corrupt_structure();
    } else if (!is_aligned(host, cs_)) {
      note("ERROR refcount block {} is not cluster aligned; refcount table entry corrupted", i);
      corrupt_structure();
    } else if (host != 0 && hc >= div_round_up(file_.size(), cs_)) {
      note("ERROR refcount block {} is outside image", i);
      corrupt_structure();
    } else if (host != 0) {
      inc(host, cs_);
      if (counted_[hc] != 1) {
        note("ERROR refcount block {} refcount={}", i, counted_[hc]);
        corrupt_structure();
      }
    }
  }

  // Counts one reference to every host cluster of [host, host+size) (QEMU's
  // qcow2_inc_refcounts_imrt()). A region reaching a cluster or more past the
  // end of the file is a corruption and is not counted.
  void inc(HostOffset host, uint64_t size) {
    if (size == 0) return;
    uint64_t file_len = file_.size();
    if (host + size >= file_len && host + size - file_len >= cs_) {
      corruption("ERROR: counting reference for region exceeding the end of the file by one cluster or more: "
                 "offset {:#x} size {:#x}", host, size);
      return;
    }
    uint64_t max = max_refcount(h_.refcount_order);
    for (HostCluster hc = host / cs_; hc <= (host + size - 1) / cs_; ++hc) {
      if (hc >= counted_.size()) counted_.resize(hc + 1);
      if (counted_[hc] == max) {
        corruption("ERROR: overflow cluster offset={:#x}", hc * cs_);
        continue;
      }
      ++counted_[hc];
    }
  }

  Task<Status> walk_snapshots(const std::vector<Snapshot>& snapshots) {
    if (h_.has_external_data_file() && !snapshots.empty())
      corruption("ERROR {} snapshots in image with data file", snapshots.size());
    for (const Snapshot& s : snapshots) {
      if (!is_aligned(s.l1_table_offset, cs_)) {
        corruption("ERROR snapshot {} ({}) l1_offset={:#x}: L1 table is not cluster aligned; snapshot table entry "
                   "corrupted", s.id, s.name, s.l1_table_offset);
        continue;
      }
      QCOWFS_CO_TRY(co_await walk_l1(s.l1_table_offset, s.l1_size, false));
    }
    co_return Status::ok();
  }

  Task<Status> walk_l1(HostOffset l1, uint32_t l1_size, bool active) {
    if (l1_size == 0) co_return Status::ok();
    inc(l1, uint64_t{l1_size} * kL1EntrySize);
    io::AlignedBuffer buf(size_t{l1_size} * kL1EntrySize, file_.mem_align());
    if (Status st = co_await read_padded(file_, l1, buf.span()); !st) {
      note("ERROR: I/O error in check_refcounts_l1: {}", st.to_string());
      ++r_.check_errors;
      co_return Status::ok();
    }
    for (uint32_t i = 0; i < l1_size; ++i) {
      uint64_t entry = load_be64(buf.data() + size_t{i} * kL1EntrySize);
      if (active) active_l1_.push_back(entry);
      if (entry != 0) QCOWFS_CO_TRY(co_await walk_l1_entry(entry, active));
      report_progress();
    }
    co_return Status::ok();
  }

  Task<Status> walk_l1_entry(uint64_t entry, bool active) {
    HostOffset l2 = entry & kL1OffsetMask;
    inc(l2, cs_);
    if (!is_aligned(l2, cs_)) corruption("ERROR l2_offset={:#x}: Table is not cluster aligned; L1 entry corrupted", l2);
    co_return co_await walk_l2(l2, active);
  }

  void report_progress() {
    ++done_l2_;
    if (opts_.progress && done_l2_ % 64 == 0 && done_l2_ < total_l2_) opts_.progress(done_l2_ * cs_, total_l2_ * cs_);
  }

  Task<Status> walk_l2(HostOffset l2, bool active) {
    io::AlignedBuffer buf(static_cast<size_t>(cs_), file_.mem_align());
    if (Status st = co_await read_padded(file_, l2, buf.span()); !st) {
      note("ERROR: I/O error in check_refcounts_l2: {}", st.to_string());
      ++r_.check_errors;
      co_return Status::ok();
    }
    next_contiguous_ = 0;  // fragmentation is counted within each L2 table, as QEMU does
    size_t esize = g_.l2_entry_size();
    for (uint64_t i = 0; i < g_.l2_entries(); ++i) {
      const std::byte* p = buf.data() + i * esize;
      uint64_t bitmap = g_.extended_l2 ? load_be64(p + kExtendedL2BitmapOffset) : 0;
      check_l2_entry(decode_l2_entry(g_, load_be64(p), bitmap), active);
    }
    co_return Status::ok();
  }

  void check_l2_entry(const L2EntryClass& c, bool active) {
    if (c.kind == L2Kind::compressed) return count_compressed(c, active);
    if (c.mapped()) return count_data(c, active);  // normal and ZERO_ALLOC
    if (c.kind == L2Kind::unallocated && c.alloc_bits())
      corruption("ERROR: Unallocated cluster has non-zero subcluster allocation bitmap");
  }

  void count_compressed(const L2EntryClass& c, bool active) {
    if (c.copied)
      corruption("ERROR: coffset={:#x}: copied flag must never be set for compressed clusters",
                 c.compressed.host_offset);
    if (h_.has_external_data_file()) return corruption("ERROR compressed cluster with data file");
    if (c.bitmap != 0) corruption("ERROR compressed cluster {:#x} has a non-zero subcluster bitmap", c.entry);
    inc(c.compressed.host_offset, c.compressed.size);
    if (active) {
      ++r_.allocated_clusters;
      ++r_.compressed_clusters;
      ++r_.fragmented_clusters;
    }
  }

  void count_data(const L2EntryClass& c, bool active) {
    if (c.alloc_bits() & c.zero_bits())
      corruption("ERROR offset={:#x}: Allocated cluster has corrupted subcluster allocation bitmap", c.host);
    if (!is_aligned(c.host, cs_))
      corruption("ERROR offset={:#x}: Data cluster is not properly aligned; L2 entry corrupted", c.host);
    if (active) {
      ++r_.allocated_clusters;
      if (next_contiguous_ != 0 && c.host != next_contiguous_) ++r_.fragmented_clusters;
      next_contiguous_ = c.host + cs_;
    }
    if (!h_.has_external_data_file()) inc(c.host, cs_);
  }

  Task<Status> count_bitmaps() {
    if (!h_.bitmaps || !(h_.autoclear_features & kAutoclearBitmaps)) co_return Status::ok();
    inc(h_.bitmaps->directory_offset, h_.bitmaps->directory_size);
    auto bitmaps = co_await read_qcow2_bitmaps(file_, h_);
    if (!bitmaps) {
      corruption("ERROR bitmap directory: {}", bitmaps.status().to_string());
      co_return Status::ok();
    }
    for (const Bitmap& b : *bitmaps) {
      auto ranges = co_await bitmap_ranges(file_, h_, b);
      if (!ranges) {
        ++r_.check_errors;
        continue;
      }
      for (const HostRange& range : *ranges) inc(range.offset, range.length);
    }
    co_return Status::ok();
  }

  io::HostFile& file_;
  const Header& h_;
  const Geometry g_;
  const uint64_t cs_;
  CheckReport& r_;
  const CheckOptions& opts_;
  std::vector<uint64_t> counted_;  // references per host cluster
  std::vector<uint64_t> active_l1_;
  HostOffset next_contiguous_ = 0;
  uint64_t total_l2_ = 0;
  uint64_t done_l2_ = 0;
  bool rebuild_ = false;
};

}  // namespace

Task<Result<std::vector<uint64_t>>> read_reftable(io::HostFile& f, const Header& h) {
  uint64_t bytes = uint64_t{h.refcount_table_clusters} * h.cluster_size();
  io::AlignedBuffer buf(static_cast<size_t>(bytes), f.mem_align());
  QCOWFS_CO_TRY(co_await read_padded(f, h.refcount_table_offset, buf.span()));
  std::vector<uint64_t> t(bytes / kReftableEntrySize);
  for (size_t i = 0; i < t.size(); ++i) t[i] = load_be64(buf.data() + i * kReftableEntrySize);
  co_return t;
}

Task<Result<Counts>> count_references(io::HostFile& f, const Header& h, CheckReport& r, const CheckOptions& opts,
                                      const std::vector<uint64_t>* reftable) {
  auto sn = co_await read_qcow2_snapshots(f, h);
  if (!sn) co_return sn.status();
  Walker w(f, h, r, opts);
  QCOWFS_CO_TRY(co_await w.count_metadata(sn->snapshots, sn->table_bytes));
  if (reftable) w.count_refcount_structures(*reftable);
  co_return Counts{std::move(w.counted()), w.active_l1(), w.rebuild_needed()};
}

Task<Result<std::vector<HostRange>>> bitmap_ranges(io::HostFile& file, const Header& h, const Bitmap& b) {
  std::vector<HostRange> out;
  if (b.table_size == 0) co_return out;
  out.push_back(HostRange{b.table_offset, uint64_t{b.table_size} * kBitmapTableEntrySize});
  io::AlignedBuffer buf(size_t{b.table_size} * kBitmapTableEntrySize, file.mem_align());
  if (Status st = co_await read_padded(file, b.table_offset, buf.span()); !st)
    co_return st.with_context(fmt::format("reading the table of bitmap '{}'", b.name));
  for (uint32_t i = 0; i < b.table_size; ++i) {
    HostOffset host = load_be64(buf.data() + size_t{i} * kBitmapTableEntrySize) & kBitmapTableOffsetMask;
    if (host != 0) out.push_back(HostRange{host, h.cluster_size()});
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

}  // namespace qcowfs::image::qcow2
