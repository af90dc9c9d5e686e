#include "image/qcow2/snapshot_ops.h"

#include <algorithm>

#include "image/qcow2/qcow2_inspect.h"
#include "image/qcow2/qcow2_snapshot.h"
#include "image/qcow2/snapshot_refcount.h"

namespace qcowfs::image::qcow2 {
namespace {

// qemu-img keeps a name in a 256-byte buffer (QEMUSnapshotInfo.name).
constexpr size_t kMaxSnapshotNameBytes = 255;
// What qemu-img 7.2 records as the instruction count of a snapshot it makes.
constexpr uint64_t kQemuImgIcount = 0;

// ENOTSUP with no further text: QEMU's drivers return a bare -ENOTSUP here.
Status no_data_file_snapshots() { return Status::error(ENOTSUP, ""); }

// Writes the active L1 table (in place, or in `new_hc` clusters when it moves)
// and, when it moved or the disk size changed, the header fields naming it.
Task<Status> write_active_l1(SnapshotImage& im, std::vector<uint64_t> l1, uint64_t disk_size, bool moved,
                             HostCluster new_hc) {
  Header& h = im.header;
  const uint64_t bytes = l1.size() * kL1EntrySize;
  const HostOffset at = moved ? new_hc << h.cluster_bits : h.l1_table_offset;
  QCOWFS_CO_TRY(co_await write_l1_table(im.file, at, l1, moved ? im.clusters_for(bytes) * im.cluster_size() : bytes));
  QCOWFS_CO_TRY(co_await im.file.flush());
  if (moved || disk_size != h.size) {
    h.size = disk_size;
    h.l1_size = static_cast<uint32_t>(l1.size());
    h.l1_table_offset = at;
    QCOWFS_CO_TRY(co_await write_l1_location(im));
  }
  im.l1 = std::move(l1);
  co_return Status::ok();
}

// The COPIED pass over the active table, and the active L1 written if it changed.
Task<Status> fix_active_flags(SnapshotImage& im) {
  std::vector<uint64_t> l1 = im.l1;
  auto changed = co_await fix_copied_flags(im, l1);
  if (!changed) co_return changed.status();
  if (!*changed) co_return Status::ok();
  QCOWFS_CO_TRY(co_await write_l1_table(im.file, im.header.l1_table_offset, l1, l1.size() * kL1EntrySize));
  im.l1 = std::move(l1);
  co_return co_await im.file.flush();
}

}  // namespace

Task<Result<Snapshot>> create_snapshot(SnapshotImage& im, NewSnapshot request) {
  if (im.header.has_external_data_file()) co_return no_data_file_snapshots();
  if (im.snapshots.size() >= kMaxSnapshots) co_return Status::error(EFBIG, "");
  Snapshot sn;
  sn.id = next_snapshot_id(im.snapshots);
  sn.name = request.name.substr(0, kMaxSnapshotNameBytes);
  sn.date_sec = request.date_sec;
  sn.date_nsec = request.date_nsec;
  sn.disk_size = im.header.size;
  sn.icount = kQemuImgIcount;
  sn.l1_size = im.header.l1_size;
  std::vector<Snapshot> next = im.snapshots;
  // In memory: the copy's clusters, one more reference to everything the
  // active table reaches. A corrupt table fails here, before any write.
  const uint64_t l1_clusters = im.clusters_for(uint64_t{sn.l1_size} * kL1EntrySize);
  if (l1_clusters != 0) {
    auto hc = co_await allocate_clusters(im, l1_clusters);
    if (!hc) co_return hc.status();
    sn.l1_table_offset = *hc << im.header.cluster_bits;
  }
  QCOWFS_CO_TRY(co_await add_l1_refcounts(im, im.l1, +1));
  // 1. refcounts durable; 2. COPIED cleared in the active L2 and L1 tables.
  QCOWFS_CO_TRY(co_await write_refcounts(im));
  QCOWFS_CO_TRY(co_await fix_active_flags(im));
  // 3. the copy (every COPIED flag clear now), then the table and header.
  QCOWFS_CO_TRY(co_await write_l1_table(im.file, sn.l1_table_offset, im.l1, l1_clusters * im.cluster_size()));
  next.push_back(sn);
  QCOWFS_CO_TRY(co_await replace_snapshot_table(im, std::move(next)));
  co_return sn;
}

Task<Status> apply_snapshot(SnapshotImage& im, std::string id_or_name) {
  // QEMU's bdrv_snapshot_goto() refuses before asking the driver: persistent
  // bitmaps (enabled or not) are loaded dirty bitmaps once the autoclear bit is set.
  const Header& h = im.header;
  if (h.bitmaps && h.bitmaps->nb_bitmaps != 0 && (h.autoclear_features & kAutoclearBitmaps))
    co_return Status::error(EBUSY, "Device has active dirty bitmaps");
  if (im.header.has_external_data_file()) co_return no_data_file_snapshots();
  const int index = find_snapshot(im.snapshots, id_or_name);
  if (index < 0) co_return Status::error(ENOENT, "");
  const Snapshot sn = im.snapshots[static_cast<size_t>(index)];
  auto sn_l1 = co_await read_l1_table(im.file, im.header, sn.l1_table_offset, sn.l1_size);
  if (!sn_l1) co_return sn_l1.status().with_context(fmt::format("snapshot {} ({})", sn.id, sn.name));
  // The active table keeps at least its size (QEMU grows it, never shrinks it).
  const uint64_t entries = std::max<uint64_t>({im.header.l1_size, sn.l1_size, im.header.l1_entries_for(sn.disk_size)});
  if (entries * kL1EntrySize > kMaxL1Bytes) co_return Status::errorf(EFBIG, "L1 table of {} entries is too large", entries);
  const bool moved = entries > im.header.l1_size;
  std::vector<uint64_t> l1 = *sn_l1;
  l1.resize(entries, 0);
  QCOWFS_CO_TRY(co_await add_l1_refcounts(im, l1, +1));
  HostCluster new_hc = 0;
  if (moved) {
    auto hc = co_await allocate_clusters(im, im.clusters_for(entries * kL1EntrySize));
    if (!hc) co_return hc.status();
    new_hc = *hc;
  }
  // 1. the snapshot's clusters' new references durable; 2. COPIED cleared in
  // its L2 tables (refcounts are 2 or more now); 3. the active L1 replaced.
  QCOWFS_CO_TRY(co_await write_refcounts(im));
  auto fixed = co_await fix_copied_flags(im, l1);
  if (!fixed) co_return fixed.status();
  const std::vector<uint64_t> old_l1 = im.l1;
  const HostOffset old_l1_offset = im.header.l1_table_offset;
  QCOWFS_CO_TRY(co_await write_active_l1(im, std::move(l1), sn.disk_size, moved, new_hc));
  // 4. the old active table's references dropped; 5. COPIED set where now owned.
  QCOWFS_CO_TRY(co_await add_l1_refcounts(im, old_l1, -1));
  if (moved) QCOWFS_CO_TRY(co_await release_range(im, old_l1_offset, old_l1.size() * kL1EntrySize));
  QCOWFS_CO_TRY(co_await write_refcounts(im));
  co_return co_await fix_active_flags(im);
}

Task<Status> delete_snapshot(SnapshotImage& im, std::string id, std::string name) {
  if (im.header.has_external_data_file()) co_return no_data_file_snapshots();
  const int index = find_snapshot_by_id_and_name(im.snapshots, id, name);
  if (index < 0) co_return Status::error(ENOENT, "Can't find the snapshot");
  const Snapshot sn = im.snapshots[static_cast<size_t>(index)];
  auto sn_l1 = co_await read_l1_table(im.file, im.header, sn.l1_table_offset, sn.l1_size);
  if (!sn_l1) co_return sn_l1.status().with_context(fmt::format("snapshot {} ({})", sn.id, sn.name));
  // Validated whole before the entry goes: past that point a failure leaks.
  QCOWFS_CO_TRY(co_await add_l1_refcounts(im, *sn_l1, 0));
  std::vector<Snapshot> next = im.snapshots;
  next.erase(next.begin() + index);
  QCOWFS_CO_TRY(co_await replace_snapshot_table(im, std::move(next)));
  QCOWFS_CO_TRY(co_await add_l1_refcounts(im, *sn_l1, -1));
  QCOWFS_CO_TRY(co_await release_range(im, sn.l1_table_offset, uint64_t{sn.l1_size} * kL1EntrySize));
  QCOWFS_CO_TRY(co_await write_refcounts(im));
  co_return co_await fix_active_flags(im);
}

}  // namespace qcowfs::image::qcow2

namespace qcowfs::image {
namespace {

SnapshotEntry describe(const qcow2::Snapshot& s) {
  SnapshotEntry e;
  e.info.id = s.id;
  e.info.name = s.name;
  e.info.disk_size = s.disk_size;
  e.info.vm_state_size = s.vm_state_size;
  e.info.date_sec = s.date_sec;
  e.info.date_nsec = s.date_nsec;
  e.info.vm_clock_ns = s.vm_clock_nsec;
  if (s.icount != ~uint64_t{0}) e.icount = s.icount;
  return e;
}

Task<Result<std::vector<SnapshotEntry>>> list_qcow2(io::HostFile& file) {
  auto h = co_await qcow2::read_qcow2_header(file);
  if (!h) co_return h.status();
  auto table = co_await qcow2::read_qcow2_snapshots(file, *h);
  if (!table) co_return table.status();
  std::vector<SnapshotEntry> out;
  for (const auto& s : table->snapshots) out.push_back(describe(s));
  co_return out;
}

Task<Result<SnapshotEntry>> create_qcow2(io::HostFile& file, NewSnapshot request) {
  auto im = co_await qcow2::load_snapshot_image(file);
  if (!im) co_return im.status();
  auto sn = co_await qcow2::create_snapshot(**im, std::move(request));
  if (!sn) co_return sn.status();
  co_return describe(*sn);
}

Task<Status> apply_qcow2(io::HostFile& file, std::string id_or_name) {
  auto im = co_await qcow2::load_snapshot_image(file);
  if (!im) co_return im.status();
  co_return co_await qcow2::apply_snapshot(**im, std::move(id_or_name));
}

Task<Status> remove_qcow2(io::HostFile& file, std::string id, std::string name) {
  auto im = co_await qcow2::load_snapshot_image(file);
  if (!im) co_return im.status();
  co_return co_await qcow2::delete_snapshot(**im, std::move(id), std::move(name));
}

}  // namespace

const SnapshotOps kQcow2SnapshotOps = {
    .list = list_qcow2,
    .create = create_qcow2,
    .apply = apply_qcow2,
    .remove = remove_qcow2,
};

}  // namespace qcowfs::image
