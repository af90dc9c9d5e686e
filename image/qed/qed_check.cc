// check_qed(): one pass walks the L1 table and every L2 table it names in
// pieces, marking the clusters they use in a bitmap, clearing invalid entries
// when fixing; then the unmarked clusters are counted as leaks. qemu-img
// check's double check (a second pass without fixes) follows a repair.
#include "image/qed/qed_check.h"

#include <algorithm>
#include <vector>

#include "image/check_open.h"
#include "image/endian.h"
#include "image/extent/host_read.h"
#include "image/qed/format.h"
#include "image/qed/header.h"
#include "image/qed/qed.h"

namespace qcowfs::image {
namespace {

using qed::Header;

// Table bytes read (and written back when fixed) at a time.
constexpr uint64_t kPiece = 1 << 20;

// QEMU's used_clusters bitmap: one bit a cluster of the file.
class UsedClusters {
 public:
  explicit UsedClusters(uint64_t clusters) : used_(static_cast<size_t>(clusters)) {}
  // Marks n clusters from `first`; returns how many were already marked.
  uint64_t mark(uint64_t first, uint64_t n) {
    uint64_t again = 0;
    for (uint64_t c = first; c < first + n && c < used_.size(); ++c) {
      if (used_[static_cast<size_t>(c)]) ++again;
      used_[static_cast<size_t>(c)] = true;
    }
    return again;
  }
  uint64_t unmarked_from(uint64_t first) const {
    if (first >= used_.size()) return 0;
    return static_cast<uint64_t>(std::count(used_.begin() + static_cast<ptrdiff_t>(first), used_.end(), false));
  }

 private:
  std::vector<bool> used_;
};

class Walk {
 public:
  Walk(io::HostFile& file, const Header& h, bool fix)
      : file_(file), h_(h), fix_(fix), used_(h.file_size / h.cluster_size) {}

  Task<Result<CheckReport>> run(const CheckOptions& opts);

 private:
  // Visits the 64-bit entries of the L2 table at host in pieces; visit(entry)
  // returns false to clear it (only ever when fixing), and a piece with a
  // cleared entry is written back.
  template <typename Visit>
  Task<Status> each_entry(uint64_t host, Visit visit);
  Task<void> check_l2(uint64_t l2);
  Task<bool> check_l1_entry(uint64_t l2);
  Task<Status> check_l1(const CheckOptions& opts);
  bool invalid_entry() {
    if (!fix_) ++r_.corruptions;
    else ++r_.corruptions_fixed;
    return !fix_;
  }
  uint64_t cluster_of(uint64_t host) const { return host / h_.cluster_size; }

  io::HostFile& file_;
  const Header& h_;
  bool fix_;
  UsedClusters used_;
  CheckReport r_;
  Status last_error_;
};

template <typename Visit>
Task<Status> Walk::each_entry(uint64_t host, Visit visit) {
  std::vector<std::byte> piece(static_cast<size_t>(std::min(h_.table_bytes(), kPiece)));
  for (uint64_t off = 0; off < h_.table_bytes(); off += piece.size()) {
    QCOWFS_CO_TRY(co_await read_padded(file_, host + off, piece));
    bool changed = false;
    for (size_t at = 0; at < piece.size(); at += sizeof(uint64_t)) {
      if (visit(load_le64(piece.data() + at))) continue;
      store_le64(piece.data() + at, qed::kUnallocated);
      changed = true;
    }
    if (changed) QCOWFS_CO_TRY(co_await file_.write(host + off, piece));
  }
  co_return Status::ok();
}

// qed_check_l2_table(): allocated and fragmented clusters as QEMU counts them
// (invalid entries included), each valid data cluster marked once.
Task<void> Walk::check_l2(uint64_t l2) {
  uint64_t last = 0;
  Status st = co_await each_entry(l2, [&](uint64_t e) {
    if (e == qed::kUnallocated || e == qed::kZeroCluster) return true;
    ++r_.allocated_clusters;
    if (last != 0 && last + h_.cluster_size != e) ++r_.fragmented_clusters;
    last = e;
    if (!h_.valid_cluster_offset(e)) return invalid_entry();
    r_.corruptions += used_.mark(cluster_of(e), 1);
    return true;
  });
  if (!st) {
    ++r_.check_errors;
    r_.messages.push_back(fmt::format("ERROR reading or writing the L2 table at {:#x}: {}", l2, st.to_string()));
    last_error_ = std::move(st);
  }
}

// An L1 entry and its L2 table, in QEMU's order (qed_check_l1_table): an
// invalid table offset is a corruption; a table sharing a cluster with one
// marked before is skipped. Returns false to clear the entry.
Task<bool> Walk::check_l1_entry(uint64_t l2) {
  if (l2 == qed::kUnallocated) co_return true;
  if (!h_.valid_table_offset(l2)) co_return invalid_entry();
  const uint64_t again = used_.mark(cluster_of(l2), h_.table_size);
  r_.corruptions += again;
  if (again == 0) co_await check_l2(l2);
  co_return true;
}

// The L1 table in pieces, each written back when an entry in it was cleared.
// No L2 table shares a cluster with it, so fixing them cannot change a piece.
Task<Status> Walk::check_l1(const CheckOptions& opts) {
  std::vector<std::byte> piece(static_cast<size_t>(std::min(h_.table_bytes(), kPiece)));
  for (uint64_t off = 0; off < h_.table_bytes(); off += piece.size()) {
    QCOWFS_CO_TRY(co_await read_padded(file_, h_.l1_table_offset + off, piece));
    bool changed = false;
    for (size_t at = 0; at < piece.size(); at += sizeof(uint64_t)) {
      if (co_await check_l1_entry(load_le64(piece.data() + at))) continue;
      store_le64(piece.data() + at, qed::kUnallocated);
      changed = true;
    }
    if (changed) QCOWFS_CO_TRY(co_await file_.write(h_.l1_table_offset + off, piece));
    if (opts.progress) opts.progress(off + piece.size(), h_.table_bytes());
  }
  co_return Status::ok();
}

Task<Result<CheckReport>> Walk::run(const CheckOptions& opts) {
  r_.total_clusters = (h_.image_size + h_.cluster_size - 1) / h_.cluster_size;
  used_.mark(cluster_of(h_.l1_table_offset), h_.table_size);
  Status st = co_await check_l1(opts);
  if (!st) {
    ++r_.check_errors;
    r_.messages.push_back(fmt::format("ERROR reading or writing the L1 table: {}", st.to_string()));
    last_error_ = std::move(st);
  }
  // Leaks only when the whole image could be read (qed_check_for_leaks).
  if (last_error_.is_ok()) r_.leaks = used_.unmarked_from(h_.header_size);
  co_return std::move(r_);
}

// qed_check_mark_clean(): after a fix that left no corruption, the fixes are
// flushed and then the need-check bit cleared.
Task<Status> mark_clean(io::HostFile& file, Header& h) {
  if (!h.need_check()) co_return Status::ok();
  QCOWFS_CO_TRY(co_await file.flush());
  h.features &= ~qed::kFeatureNeedCheck;
  std::byte field[8];
  store_le64(field, h.features);
  QCOWFS_CO_TRY(co_await file.write(offsetof(qed::HeaderLayout, features), field));
  co_return co_await file.flush();
}

}  // namespace

Task<Result<CheckReport>> check_qed(io::HostFile& file, std::string path, CheckOptions opts) {
  const bool fix = opts.repair != RepairMode::none;
  if (fix && !file.writable()) co_return Status::error(EROFS, "repairing needs the image opened read-write");
  QCOWFS_CO_TRY(co_await open_for_check(file, path, open_qed));
  auto h = co_await qed::read_header(file, path);
  if (!h) co_return h.status();
  auto first = co_await Walk(file, *h, fix).run(opts);
  if (!first) co_return first;
  if (fix && first->corruptions == 0 && first->check_errors == 0) QCOWFS_CO_TRY(co_await mark_clean(file, *h));
  if (first->corruptions_fixed == 0) co_return first;
  // qemu-img's double check of the fixed image, reported with the fixes.
  QCOWFS_CO_TRY(co_await file.flush());
  auto second = co_await Walk(file, *h, false).run(CheckOptions{});
  if (!second) co_return second;
  second->corruptions_fixed = first->corruptions_fixed;
  first->messages.insert(first->messages.end(), second->messages.begin(), second->messages.end());
  second->messages = std::move(first->messages);
  co_return second;
}

}  // namespace qcowfs::image
