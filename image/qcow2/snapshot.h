// qcow2 internal snapshot table: parsing and validation of the variable-length
// entries (ID, name, extra data), and writing a table back, as pure functions
// over the table's bytes; the lookups and the ID QEMU's block/qcow2-snapshot.c uses.
// Thread-safety: plain values and pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "image/qcow2/header.h"
#include "io/status.h"

namespace qcowfs::image::qcow2 {

struct Snapshot {
  uint64_t l1_table_offset = 0;
  uint32_t l1_size = 0;
  std::string id;
  std::string name;
  uint32_t date_sec = 0;
  uint32_t date_nsec = 0;
  uint64_t vm_clock_nsec = 0;
  uint64_t vm_state_size = 0;
  uint64_t disk_size = 0;
  uint64_t icount = ~uint64_t{0};  // ~0: the entry records none (QEMU's -1)
  std::vector<std::byte> extra;  // the entry's extra data, verbatim (kept for rewriting)
};

struct SnapshotTable {
  std::vector<Snapshot> snapshots;
  // > 0 when `table` was too short: the caller reads this many bytes and retries.
  uint64_t needed_bytes = 0;
  uint64_t table_bytes = 0;  // total size of the table when complete
};

// Parses h.nb_snapshots entries from `table` (bytes read at h.snapshots_offset).
// Entries must fit in the file and QEMU's limits; snapshot L1 tables must be
// aligned, bounded and inside the file.
Result<SnapshotTable> parse_snapshot_table(std::span<const std::byte> table, const Header& h, uint64_t file_size);

// Index of the snapshot whose ID is `id_or_name`, else whose name is; -1 if none
// (QEMU's find_snapshot_by_id_or_name()).
int find_snapshot(const std::vector<Snapshot>& snapshots, const std::string& id_or_name);

// Index of the first snapshot with this ID and this name; an empty id or name
// matches any (QEMU's find_snapshot_by_id_and_name()); -1 if none.
int find_snapshot_by_id_and_name(const std::vector<Snapshot>& snapshots, const std::string& id,
                                 const std::string& name);

// The ID QEMU gives a new snapshot: one more than the largest numeric ID
// (each ID read as strtoul() reads it), "1" for the first.
std::string next_snapshot_id(const std::vector<Snapshot>& snapshots);

// The table as QEMU's qcow2_write_snapshots() writes it: entries 8-byte
// aligned, each with at least the 24 bytes of extra data QEMU 7.2 knows
// (vm_state_size, disk_size, icount from the fields) followed by any longer
// extra data kept verbatim, then ID and name. EFBIG past QEMU's table size limit.
Result<std::vector<std::byte>> serialize_snapshot_table(const std::vector<Snapshot>& snapshots);

}  // namespace qcowfs::image::qcow2
