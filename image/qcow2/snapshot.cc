#include "image/qcow2/snapshot.h"

#include "image/endian.h"
#include "io/align.h"

namespace qcowfs::image::qcow2 {
namespace {

Status invalid(uint32_t index, std::string msg) {
  return Status::errorf(EINVAL, "invalid qcow2 snapshot table entry {}: {}", index, msg);
}

template <typename T>
T sn_field(const std::byte* p, size_t at) {
  return load_be<T>(p + at);
}
#define SN_FIELD(p, name) \
  sn_field<decltype(SnapshotHeaderLayout::name)>(p, offsetof(SnapshotHeaderLayout, name))

Status check_snapshot_l1(uint32_t index, const Snapshot& s, const Header& h, uint64_t file_size) {
  uint64_t bytes = uint64_t{s.l1_size} * kL1EntrySize;
  if (bytes > kMaxL1Bytes) return invalid(index, fmt::format("L1 table of {} entries is too large", s.l1_size));
  if (s.l1_size == 0) return Status::ok();
  if (!is_aligned(s.l1_table_offset, h.cluster_size()) ||
      !range_inside_file(s.l1_table_offset, bytes, h.cluster_size(), file_size))
    return invalid(index, fmt::format("L1 table at {:#x} ({} entries) is misaligned or outside the file",
                                      s.l1_table_offset, s.l1_size));
  return Status::ok();
}

void parse_extra(Snapshot& s, const std::byte* extra, uint32_t size, const Header& h) {
  s.extra.assign(extra, extra + size);
  if (size >= offsetof(SnapshotExtraLayout, disk_size)) s.vm_state_size = load_be64(extra);
  s.disk_size = size >= offsetof(SnapshotExtraLayout, icount) ? load_be64(extra + offsetof(SnapshotExtraLayout, disk_size))
                                                              : h.size;
}

// The fields of the entry at p; var: its variable part (extra data, id, name).
Snapshot read_snapshot_entry(const std::byte* p, uint32_t extra, uint16_t id_len, uint16_t name_len, const Header& h) {
  Snapshot s;
  s.l1_table_offset = SN_FIELD(p, l1_table_offset);
  s.l1_size = SN_FIELD(p, l1_size);
  s.date_sec = SN_FIELD(p, date_sec);
  s.date_nsec = SN_FIELD(p, date_nsec);
  s.vm_clock_nsec = SN_FIELD(p, vm_clock_nsec);
  s.vm_state_size = SN_FIELD(p, vm_state_size);
  const std::byte* var = p + sizeof(SnapshotHeaderLayout);
  parse_extra(s, var, extra, h);
  s.id.assign(reinterpret_cast<const char*>(var + extra), id_len);
  s.name.assign(reinterpret_cast<const char*>(var + extra + id_len), name_len);
  return s;
}

}  // namespace

Result<SnapshotTable> parse_snapshot_table(std::span<const std::byte> table, const Header& h, uint64_t file_size) {
  SnapshotTable out;
  uint64_t limit = std::min(kMaxSnapshotTableBytes, file_size - std::min(file_size, h.snapshots_offset));
  uint64_t pos = 0;
  for (uint32_t i = 0; i < h.nb_snapshots; ++i) {
    pos = align_up(pos, kSnapshotEntryAlign);
    if (pos + sizeof(SnapshotHeaderLayout) > limit)
      return invalid(i, "the snapshot table runs past the end of the file or its size limit");
    if (pos + sizeof(SnapshotHeaderLayout) > table.size()) {
      out.needed_bytes = pos + sizeof(SnapshotHeaderLayout);
      return out;
    }
    const std::byte* p = table.data() + pos;
    uint32_t extra = SN_FIELD(p, extra_data_size);
    uint16_t id_len = SN_FIELD(p, id_str_size), name_len = SN_FIELD(p, name_size);
    if (extra > kMaxSnapshotExtraData) return invalid(i, fmt::format("{} bytes of extra data (max {})", extra, kMaxSnapshotExtraData));
    uint64_t entry = sizeof(SnapshotHeaderLayout) + uint64_t{extra} + id_len + name_len;
    if (pos + entry > limit) return invalid(i, "the entry runs past the end of the file or the table size limit");
    if (pos + entry > table.size()) {
      out.needed_bytes = pos + entry;
      return out;
    }
    Snapshot s = read_snapshot_entry(p, extra, id_len, name_len, h);
    QCOWFS_TRY(check_snapshot_l1(i, s, h, file_size));
    out.snapshots.push_back(std::move(s));
    pos += entry;
  }
  out.table_bytes = pos;
  return out;
}

int find_snapshot(const std::vector<Snapshot>& snapshots, const std::string& id_or_name) {
  for (size_t i = 0; i < snapshots.size(); ++i)
    if (snapshots[i].id == id_or_name) return static_cast<int>(i);
  for (size_t i = 0; i < snapshots.size(); ++i)
    if (snapshots[i].name == id_or_name) return static_cast<int>(i);
  return -1;
}

}  // namespace qcowfs::image::qcow2
