// VhdxWriter: the ExtentWriter of a VHDX image (dynamic or fixed) opened
// read-write, as QEMU 7.2's vhdx_co_writev() writes one:
// - before the first change of an open, both headers are updated (a new
//   DataWriteGuid and this open's FileWriteGuid, sequence number + 1 each),
//   durably (vhdx_user_visible_write);
// - a block that is not FULLY_PRESENT (NOT_PRESENT, UNDEFINED, ZERO, UNMAPPED)
//   gets a new block at the end of the file, rounded up to 1 MiB
//   (vhdx_allocate_block); the file is extended at once, so the rest of the
//   block reads as zeros; its BAT entry becomes FULLY_PRESENT with the
//   block's MiB offset;
// - every BAT change goes through the log (log_writer.h): write_metadata()
//   turns the changed 4 KiB BAT sectors into log entries, each written,
//   flushed, applied in place, flushed, and the log emptied again;
// - a dynamic image unmaps discarded whole blocks (can_unmap(), unmap()):
//   their entries become PAYLOAD_BLOCK_UNMAPPED with FileOffsetMB 0 (one of
//   the specification's choices, and what QEMU's vhdx_update_bat_table_entry
//   stores for that state), so no entry names their space any more; the core
//   punches it and, once the new entries are written back, hands it back
//   (recycle()): reserve() then puts new blocks there, zeroed first, before
//   going to the end of the file. Only space this open unmapped is reused.
// A fixed image (LeaveBlocksAllocated) never unmaps: discarded blocks stay
// FULLY_PRESENT and are zeroed in place; with every block FULLY_PRESENT it
// never allocates either.
// BAT entries change in pinned TableCache slices that BatMap reads (atomic
// stores); the changed slices stay pinned until written.
// Thread-safety: as ExtentWriter (calls under the driver's allocation lock;
// can_unmap() is constant).
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>

#include "image/extent/writer.h"
#include "image/extent/slice_set.h"
#include "image/vhdx/bat.h"
#include "image/vhdx/header.h"
#include "image/vhdx/log_writer.h"

namespace qcowfs::image::vhdx {

class VhdxWriter final : public ExtentWriter {
 public:
  struct Params {
    Geometry geometry;
    Header header;                        // the current header (its log region)
    uint64_t first_free = 0;              // where new blocks go (check_bat_writable)
    uint64_t next_sequence = 1;           // of the next log entry
    bool headers_updated = false;         // the open's log replay updated them already
    bool leave_blocks_allocated = false;  // the file parameters' flag: a fixed image
  };
  VhdxWriter(io::HostFile& file, std::string path, const Params& p, BatMap& map, HeaderPair headers);

  uint64_t unit_size() const override { return g_.block_size; }
  Task<Status> before_first_write() override;
  Task<Status> prepare(uint64_t first, uint64_t n) override;
  Task<Result<HostRun>> reserve(uint64_t first, uint64_t n) override;
  void unreserve(const HostRun& run) override;
  void publish(uint64_t first, const HostRun& run) override;
  bool can_unmap() const override { return !leave_blocks_allocated_; }
  void unmap(uint64_t first, uint64_t n) override;
  void recycle(const HostRun& space) override;
  bool dirty() const override { return slices_.dirty(); }
  Task<Status> write_metadata() override;

 private:
  void store(uint64_t block, uint64_t entry);
  Task<Result<HostRun>> reuse(uint64_t n);
  void add_free(uint64_t host, uint64_t n);

  io::HostFile& file_;
  std::string path_;
  const Geometry g_;
  const Header h_;
  BatMap& map_;
  HeaderPair headers_;
  FileTail tail_;  // where the next block goes (a multiple of 1 MiB)
  uint64_t next_sequence_;
  bool headers_updated_;
  const bool leave_blocks_allocated_;
  SliceSet slices_;  // the BAT slices prepare() pinned and publish() or unmap() changed
  // Recycled space (recycle()): host offset -> blocks there, neighbours merged.
  std::map<uint64_t, uint64_t> free_;
  // Host offsets of reservations taken from free_ and not yet published or
  // given back (unreserve() returns those to free_, not to the tail).
  std::set<uint64_t> reused_;
};

}  // namespace qcowfs::image::vhdx
