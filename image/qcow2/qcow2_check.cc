#include "image/qcow2/qcow2_check.h"

#include "image/qcow2/qcow2.h"

#include "image/backing.h"
#include "image/path.h"

#include "image/endian.h"
#include "image/qcow2/check_repair.h"
#include "image/qcow2/check_walk.h"
#include "image/qcow2/qcow2_inspect.h"
#include "io/align.h"

namespace qcowfs::image::qcow2 {
namespace {

// Clears the dirty and corrupt bits after a successful repair (v3 only).
Task<Status> mark_clean(io::HostFile& f, Header& h) {
  uint64_t bits = kIncompatDirty | kIncompatCorrupt;
  if (h.version < 3 || !(h.incompatible_features & bits)) co_return Status::ok();
  h.incompatible_features &= ~bits;
  std::byte field[8];
  store_be64(field, h.incompatible_features);
  QCOWFS_CO_TRY(co_await f.write(offsetof(HeaderLayout, incompatible_features), field));
  co_return co_await f.flush();
}

// RepairMode::all with a broken refcount structure or refcounts too low: a
// fresh structure, then OFLAG_COPIED against it. The report is the one of the
// comparison, every problem counted as fixed.
Task<Result<CheckReport>> repair_by_rebuilding(io::HostFile& f, Header& h, CheckReport compared, const Counts& counts) {
  QCOWFS_CO_TRY(co_await rebuild_refcounts(f, h));
  compared.messages.push_back("Rebuilding refcount structure");
  CheckReport r = std::move(compared);
  r.corruptions_fixed = r.corruptions;
  r.leaks_fixed = r.leaks;
  r.corruptions = r.leaks = 0;
  auto new_table = co_await read_reftable(f, h);
  if (!new_table) co_return new_table.status();
  StoredRefcounts rebuilt(f, h, std::move(*new_table));
  QCOWFS_CO_TRY(co_await check_oflag_copied(f, h, rebuilt, r, true, counts.active_l1));
  co_return r;
}

// One check pass; with a repair mode, repairs as it goes. `r` holds what the
// walk found, `compared` that plus the comparison of the refcounts.
Task<Result<CheckReport>> check_pass(io::HostFile& f, Header& h, const CheckOptions& opts) {
  CheckReport r;
  r.total_clusters = div_round_up(h.size, h.cluster_size());
  uint64_t nb_clusters = div_round_up(f.size(), h.cluster_size());
  auto reftable = co_await read_reftable(f, h);
  if (!reftable) co_return reftable.status();
  auto counts = co_await count_references(f, h, r, opts, &*reftable);
  if (!counts) co_return counts.status();
  StoredRefcounts stored(f, h, std::move(*reftable));
  HostCluster highest = 0;
  CheckReport compared = r;
  QCOWFS_CO_TRY(co_await compare_refcounts(stored, counts->counted, nb_clusters, false, compared, highest));
  bool need_rebuild = counts->rebuild_needed || compared.corruptions > r.corruptions;
  if (opts.repair == RepairMode::all && need_rebuild) co_return co_await repair_by_rebuilding(f, h, compared, *counts);
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
  // As qemu: any -r repairs OFLAG_COPIED.
  QCOWFS_CO_TRY(co_await check_oflag_copied(f, h, stored, r, opts.repair != RepairMode::none, counts->active_l1));
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

namespace qcowfs::image {

namespace {

// What qemu-img check does before it checks: it opens the image with its
// backing chain and external data file, so one that is missing or is no file
// (a FIFO, a directory) fails the check. These opens take no locks (the check
// holds the image's own; with -U others may hold the rest) and read nothing
// but the backing chain's headers. An unreadable header is left to
// check_image(), which reports it.
Task<Status> open_files_for_check(io::HostFile& file, const std::string& path) {
  auto h = co_await qcow2::read_qcow2_header(file);
  if (!h) co_return Status::ok();
  ImageOptions opts;
  opts.file.locking = io::LockMode::off;
  if (h->has_external_data_file() && !h->data_file.empty()) {
    auto data = io::open_host_file(resolve_relative(path, h->data_file), opts.file);
    if (!data) co_return data.status().with_context(fmt::format("opening external data file of {}", path));
  }
  if (h->backing_file.empty()) co_return Status::ok();
  auto backing = co_await open_backing_file(path, h->backing_file, h->backing_format, opts);
  if (!backing) co_return backing.status();
  co_return co_await (*backing)->close();
}

}  // namespace

Task<Result<CheckReport>> check_qcow2(io::HostFile& file, std::string path, CheckOptions opts) {
  QCOWFS_CO_TRY(co_await open_files_for_check(file, path));
  co_return co_await qcow2::check_image(file, std::move(opts));
}

}  // namespace qcowfs::image
