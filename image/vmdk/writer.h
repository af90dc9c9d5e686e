// VmdkWriter: the ExtentWriter of a VMDK image opened read-write
// (monolithicSparse, twoGbMaxExtentSparse, monolithicFlat, twoGbMaxExtentFlat
// and their mixtures), as QEMU 7.2's vmdk_pwritev() writes one, crash-safe:
//
//   - FLAT extents are written in place (their extents are data; nothing is
//     allocated);
//   - a new grain of a sparse extent goes at the end of its file, rounded up
//     to the grain size (QEMU's next_cluster_sector); all new grains of one
//     run are contiguous there, and a run never leaves its extent
//     (run_limit());
//   - grain tables are never allocated: a writable open needs every grain
//     table in place (what qemu-img and VMware create; QEMU cannot write a
//     grain whose table is missing either), so the grain directories never
//     change. A grain-table entry changes in its pinned TableCache window
//     and, with a redundant grain directory, in the redundant grain table's
//     window too (QEMU's vmdk_L2update); write_metadata() writes the changed
//     windows after the driver made the grains durable;
//   - the descriptor's CID gets a new random value, durably, before the
//     first change of each open (vmdk_write_cid), so deltas made on this
//     image see that it changed. VMDK has no dirty flag.
//
// Thread-safety: as ExtentWriter (calls under the driver's allocation lock);
// readers see published entries through VmdkMap's atomic loads.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "image/extent/writer.h"
#include "image/extent/slice_set.h"
#include "image/extent/table_cache.h"
#include "image/vmdk/map.h"

namespace qcowfs::image::vmdk {

// Where the CID lives: the descriptor file (the whole file is its text) or
// the descriptor embedded in a sparse extent ([offset, offset + size)).
struct DescriptorPlace {
  io::HostFile* file = nullptr;
  bool whole_file = true;
  uint64_t offset = 0;
  uint64_t size = 0;
};

class VmdkWriter final : public ExtentWriter {
 public:
  // grain: the grain size of every sparse extent (each starts at a multiple
  // of it; the opener checked that and everything check_writable() checks).
  VmdkWriter(std::string path, VmdkMap& map, uint64_t grain, DescriptorPlace desc);

  uint64_t unit_size() const override { return grain_; }
  Task<Status> before_first_write() override;
  uint64_t run_limit(uint64_t first) const override;
  Task<Status> prepare(uint64_t first, uint64_t n) override;
  Task<Result<HostRun>> reserve(uint64_t first, uint64_t n) override;
  void unreserve(const HostRun& run) override;
  void publish(uint64_t first, const HostRun& run) override;
  bool has_zero_state(uint64_t unit) const override;
  void mark_zero(uint64_t first, uint64_t n) override;
  bool dirty() const override { return slices_.dirty(); }
  Task<Status> write_metadata() override;

 private:
  // A grain-table entry: its window (a slice of the file's cache) and byte in it.
  struct EntryAt {
    TableCache* cache = nullptr;
    uint64_t window = 0;
    size_t at = 0;
  };

  Result<std::vector<EntryAt>> entries_of(uint64_t unit) const;
  void store(uint64_t unit, uint32_t gte);
  Task<Status> cover_grains();

  std::string path_;
  VmdkMap& map_;
  uint64_t grain_;
  DescriptorPlace desc_;
  std::map<io::HostFile*, FileTail> tails_;  // per sparse extent file: where its next grain goes
  SliceSet slices_;                          // the grain-table windows prepare() pinned and publish() changed
};

// Whether the opened extents can be written (the grain size every sparse
// extent shares, 0 when there is none); EROFS naming what stops it, with
// advice to mount read-only. Reads every grain table (a writable open only).
Task<Result<uint64_t>> check_writable(const std::string& path, const std::vector<VExtent>& extents);

}  // namespace qcowfs::image::vmdk
