// QedWriter: the ExtentWriter of a QED image opened read-write, as QEMU 7.2's
// qed.c writes one. New clusters and L2 tables go at the end of the file (QED
// has no free-space map: the file's end is the allocator). The need-check
// feature bit (QED's dirty bit) is set and flushed before the first
// allocation and cleared on a clean close. L2 entries change in pinned
// TableCache slices, L1 entries in memory; write_metadata() writes the changed
// L2 slices, flushes, then the changed L1 sectors, so the L1 never names an L2
// table that is not on disk, and no L2 entry reaches the disk before its data
// (ExtentDriver flushes the data first). A new L2 table is written (zeros) when
// it is allocated, before anything names it.
// Thread-safety: as ExtentWriter (calls under the driver's allocation lock);
// readers see entries through QedMap's atomic loads.
#pragma once

#include <cstdint>
#include <string>

#include "image/extent/writer.h"
#include "image/qed/header.h"
#include "image/qed/map.h"
#include "image/extent/slice_set.h"
#include "io/buffer.h"

namespace qcowfs::image::qed {

class QedWriter final : public ExtentWriter {
 public:
  // header_sector: the file's first kSectorSize bytes; l1_bytes: the file's
  // bytes [l1_table_offset, l1_table_offset + l1_bytes_size(map)).
  QedWriter(io::HostFile& file, std::string path, const Header& h, QedMap& map, io::AlignedBuffer header_sector,
            io::AlignedBuffer l1_bytes);

  // The L1 bytes kept in memory: the entries the map holds, sector-rounded.
  static uint64_t l1_bytes_size(const QedMap& map);

  uint64_t unit_size() const override { return h_.cluster_size; }
  Task<Status> begin_change() override;
  Task<Status> prepare(uint64_t first, uint64_t n) override;
  Task<Result<HostRun>> reserve(uint64_t first, uint64_t n) override;
  void unreserve(const HostRun& run) override;
  void publish(uint64_t first, const HostRun& run) override;
  bool has_zero_state(uint64_t /*unit*/) const override { return true; }
  void mark_zero(uint64_t first, uint64_t n) override;
  bool dirty() const override { return slices_.dirty() || !l1_dirty_.empty(); }
  Task<Status> write_metadata() override;
  Task<Status> close_clean() override;
  bool resizable() const override { return true; }
  Task<Status> grow(uint64_t new_size) override;

  // Clears a need-check bit found at open (after the open's own check).
  Task<Status> clear_need_check() { co_return co_await write_features(h_.features & ~kFeatureNeedCheck); }

 private:
  Task<Status> write_header_field(size_t at, uint64_t value);
  Task<Status> write_features(uint64_t features);
  Task<Status> new_l2_table(uint64_t l1_index);
  void store(uint64_t unit, uint64_t entry);
  Task<Status> cover_allocated();
  Task<Status> write_l1();

  io::HostFile& file_;
  std::string path_;
  Header h_;
  QedMap& map_;
  io::AlignedBuffer header_;
  io::AlignedBuffer l1_bytes_;
  FileTail tail_;  // where the next cluster or table goes
  bool need_check_set_ = false;
  SliceSet slices_;      // the L2 slices prepare() pinned and publish() changed
  DirtyRange l1_dirty_;  // L1 entries changed
};

}  // namespace qcowfs::image::qed
