#include "image/qcow2/snapshot.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

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
  if (size >= sizeof(SnapshotExtraLayout)) s.icount = load_be64(extra + offsetof(SnapshotExtraLayout, icount));
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

int find_snapshot_by_id_and_name(const std::vector<Snapshot>& snapshots, const std::string& id,
                                 const std::string& name) {
  for (size_t i = 0; i < snapshots.size(); ++i)
    if ((id.empty() || snapshots[i].id == id) && (name.empty() || snapshots[i].name == name)) return static_cast<int>(i);
  return -1;
}

std::string next_snapshot_id(const std::vector<Snapshot>& snapshots) {
  unsigned long max_id = 0;
  for (const Snapshot& s : snapshots) max_id = std::max(max_id, std::strtoul(s.id.c_str(), nullptr, 10));
  return std::to_string(max_id + 1);
}

namespace {

size_t extra_bytes(const Snapshot& s) { return std::max(sizeof(SnapshotExtraLayout), s.extra.size()); }

void put_entry(std::byte* p, const Snapshot& s) {
  auto at = [p](size_t off) { return p + off; };
  store_be64(at(offsetof(SnapshotHeaderLayout, l1_table_offset)), s.l1_table_offset);
  store_be32(at(offsetof(SnapshotHeaderLayout, l1_size)), s.l1_size);
  store_be16(at(offsetof(SnapshotHeaderLayout, id_str_size)), static_cast<uint16_t>(s.id.size()));
  store_be16(at(offsetof(SnapshotHeaderLayout, name_size)), static_cast<uint16_t>(s.name.size()));
  store_be32(at(offsetof(SnapshotHeaderLayout, date_sec)), s.date_sec);
  store_be32(at(offsetof(SnapshotHeaderLayout, date_nsec)), s.date_nsec);
  store_be64(at(offsetof(SnapshotHeaderLayout, vm_clock_nsec)), s.vm_clock_nsec);
  // Older readers see a VM state too large for 32 bits as none (QEMU does the same).
  store_be32(at(offsetof(SnapshotHeaderLayout, vm_state_size)),
             s.vm_state_size <= 0xffffffffu ? static_cast<uint32_t>(s.vm_state_size) : 0);
  const size_t extra = extra_bytes(s);
  store_be32(at(offsetof(SnapshotHeaderLayout, extra_data_size)), static_cast<uint32_t>(extra));
  std::byte* e = p + sizeof(SnapshotHeaderLayout);
  std::copy(s.extra.begin(), s.extra.end(), e);
  store_be64(e + offsetof(SnapshotExtraLayout, vm_state_size_large), s.vm_state_size);
  store_be64(e + offsetof(SnapshotExtraLayout, disk_size), s.disk_size);
  store_be64(e + offsetof(SnapshotExtraLayout, icount), s.icount);
  std::memcpy(e + extra, s.id.data(), s.id.size());
  std::memcpy(e + extra + s.id.size(), s.name.data(), s.name.size());
}

}  // namespace

Result<std::vector<std::byte>> serialize_snapshot_table(const std::vector<Snapshot>& snapshots) {
  uint64_t size = 0;
  for (const Snapshot& s : snapshots) {
    if (s.id.size() > UINT16_MAX || s.name.size() > UINT16_MAX)
      return Status::errorf(EINVAL, "snapshot ID or name of {} bytes is too long", std::max(s.id.size(), s.name.size()));
    size = align_up(size, kSnapshotEntryAlign) + sizeof(SnapshotHeaderLayout) + extra_bytes(s) + s.id.size() + s.name.size();
    if (size > kMaxSnapshotTableBytes) return Status::errorf(EFBIG, "the snapshot table would exceed {} bytes", kMaxSnapshotTableBytes);
  }
  std::vector<std::byte> table(size);
  uint64_t pos = 0;
  for (const Snapshot& s : snapshots) {
    pos = align_up(pos, kSnapshotEntryAlign);
    put_entry(table.data() + pos, s);
    pos += sizeof(SnapshotHeaderLayout) + extra_bytes(s) + s.id.size() + s.name.size();
  }
  return table;
}

}  // namespace qcowfs::image::qcow2
