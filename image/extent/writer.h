// ExtentWriter: what a writable table format (VDI, ...) adds to its ExtentMap
// so that ExtentDriver can write it. The driver owns the write path: it plans
// a request over the map, writes allocated extents in place (one host write
// per host-contiguous run), and for each guest-contiguous run of unallocated
// or zero units asks the writer for contiguous host space, writes the request
// with its copy-on-write head and tail in one host write, and then publishes
// the new mapping. The writer owns the format's metadata: where new units go,
// the table entries, and writing them back.
//
// Metadata ordering (image/extent/DESIGN.md): published entries stay in memory
// until flush(), idle writeback or close; the driver then flushes the data to
// the host before write_metadata(), so no entry on disk points at data that is
// not durable, and flushes again afterwards.
//
// Discard: a writer that can_unmap() takes whole allocated units out of the
// map on a discard (VHDX's PAYLOAD_BLOCK_UNMAPPED, VDI's discarded blocks).
// Then either the driver punches their host space and hands it back through
// recycle() once their new entries are written back and no lock-free I/O that
// saw the old ones is in flight (image/extent/in_flight.h), so a later reserve() may
// use it again (VHDX); or, for a writer that compacts() (VDI, whose new units
// go right after the allocated ones, so these must stay packed), the data of
// the last units moves into the freed space and the space at the end goes
// back to the host (begin_compaction() to end_compaction(); the driver's
// steps are in ExtentDriver::compact).
//
// Thread-safety: before_first_write(), begin_change(), prepare(), reserve(),
// unreserve(), publish(), mark_zero(), unmap(), recycle(), the compaction
// calls, before_unit_write(), write_metadata(), grow() and close_clean() are
// called with the driver's allocation lock held (one at a time, in any
// event-loop thread; write_metadata(), grow(), the compaction calls and
// close_clean() also with no reservation in flight: every reserve() before
// them was published or given back); run_limit(), has_zero_state(),
// can_unmap(), compacts() and needs_before_unit_write() with it held or not,
// from any thread (they must be pure or atomic reads;
// needs_before_unit_write() sequentially consistent where a compaction sets
// it). publish(), unmap(), mark_zero(), commit_compaction() and
// cancel_compaction() must make their entries visible to ExtentMap::try_map()
// on other threads (atomic stores).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "io/host_file.h"
#include "io/status.h"
#include "io/task.h"

namespace qcowfs::image {

// Host space for n units: [host, host + n * stride) in file, where stride is
// ExtentWriter::unit_stride(); unit i starts at host + i * stride with its
// prefix (ExtentWriter::unit_prefix(), often none), then its data.
struct HostRun {
  io::HostFile* file = nullptr;
  uint64_t host = 0;
  uint64_t units = 0;
  // The space after the first unit's prefix reads as zeros already (past the
  // data written so far): the driver need not write zero copy-on-write parts
  // it can leave out of its one host write.
  bool fresh = false;
  // Leading bytes of the first unit's prefix that the driver leaves out of
  // its host write: padding that no reader looks at (a hole in new space).
  uint64_t prefix_hole = 0;
};

// Host space handed out from the end of a file, for the formats whose file
// end is their allocator (QED, VMDK, VHDX).
struct FileTail {
  uint64_t next = 0;       // where the next unit goes
  uint64_t zero_from = 0;  // host bytes from here on read as zeros (never written)
  // n units of `unit` bytes at next.
  HostRun take(io::HostFile& f, uint64_t n, uint64_t unit) {
    HostRun run{&f, next, n, next >= zero_from};
    next += n * unit;
    return run;
  }
  // Gives back a take() whose data write failed: its space may hold part of
  // that write now, so it is no longer fresh. Only the latest take() goes
  // back to the allocator; space something else took after it since (a QED
  // L2 table) is left unused.
  void give_back(const HostRun& run, uint64_t unit) {
    const uint64_t end = run.host + run.units * unit;
    zero_from = std::max(zero_from, end);
    if (end == next) next = run.host;
  }
};

// One unit's data moving inside the image (a compaction): the unit's bytes,
// prefix included, are copied from one unit of host space to another.
struct UnitMove {
  uint64_t unit = 0;  // the guest unit
  HostRun from;       // one unit each
  HostRun to;
};

// The entries [lo, hi) of a table that changed since it was last written
// (a superset when the changes are not contiguous).
struct DirtyRange {
  uint64_t lo = 0;
  uint64_t hi = 0;
  bool empty() const { return hi <= lo; }
  void add(uint64_t first, uint64_t n) {
    if (empty()) {
      lo = first;
      hi = first + n;
      return;
    }
    lo = std::min(lo, first);
    hi = std::max(hi, first + n);
  }
  void clear() { lo = hi = 0; }
  // The bytes [first, second) of the table that hold the entries (entry_size
  // bytes each, from byte `base` of the table on), rounded out to sectors.
  std::pair<uint64_t, uint64_t> sectors(uint64_t base, uint64_t entry_size, uint64_t sector) const {
    return {(base + lo * entry_size) / sector * sector, (base + hi * entry_size + sector - 1) / sector * sector};
  }
};

class ExtentWriter {
 public:
  virtual ~ExtentWriter() = default;
  ExtentWriter() = default;
  ExtentWriter(const ExtentWriter&) = delete;
  ExtentWriter& operator=(const ExtentWriter&) = delete;

  // The allocation unit in guest bytes (a VDI block); guest unit u is
  // [u * unit_size(), (u + 1) * unit_size()).
  virtual uint64_t unit_size() const = 0;
  // The bytes the driver writes before each new unit's data, in the same host
  // write (a VHD block's padding and sector bitmap; the first unit's
  // HostRun::prefix_hole is left out). Default: none, units back to back.
  virtual std::span<const std::byte> unit_prefix() const { return {}; }
  // Host bytes from one new unit of a run to the next.
  uint64_t unit_stride() const { return unit_prefix().size() + unit_size(); }
  // Before the first change of this open of any kind (an in-place write or
  // zeroing too), durably: what QEMU updates on a first write (VMDK's CID,
  // VHDX's headers). Default: nothing.
  virtual Task<Status> before_first_write() { co_return Status::ok(); }
  // Before the first allocation of this open: the format's dirty or in-use
  // flag, durable. Default: the format has none.
  virtual Task<Status> begin_change() { co_return Status::ok(); }
  // How many units from unit `first` on may share one HostRun (a format whose
  // units live in several files: those up to the end of first's file).
  virtual uint64_t run_limit(uint64_t /*first*/) const { return UINT64_MAX; }
  // Before units [first, first + n) get host space: whatever publish() will
  // need (a format's second-level tables loaded, or allocated), so that
  // publish() cannot fail. Default: nothing.
  virtual Task<Status> prepare(uint64_t /*first*/, uint64_t /*n*/) { co_return Status::ok(); }
  // Contiguous host space for the n new units [first, first + n) (ENOSPC when
  // the image has none left).
  virtual Task<Result<HostRun>> reserve(uint64_t first, uint64_t n) = 0;
  // Gives back the latest reservation (its data write failed).
  virtual void unreserve(const HostRun& run) = 0;
  // Guest units [first, first + run.units) now map to run; visible to readers
  // at once, written back by write_metadata().
  virtual void publish(uint64_t first, const HostRun& run) = 0;
  // Whether unit `unit` can record "reads as zeros" without data (QED's zero
  // cluster, VMDK's zeroed grain), which zeroing over a backing image uses.
  virtual bool has_zero_state(uint64_t /*unit*/) const { return false; }
  // Units [first, first + n), unallocated and prepare()d, now read as zeros:
  // visible to readers at once, written back by write_metadata().
  virtual void mark_zero(uint64_t /*first*/, uint64_t /*n*/) {}
  // Whether a discard of whole allocated units unmaps them (unmap()); the same
  // answer for every unit and for the whole open. Default: never (the driver
  // zeroes their host space and they stay allocated).
  virtual bool can_unmap() const { return false; }
  // Units [first, first + n), each allocated (a data extent) and prepare()d,
  // now read as zeros and name no host space: visible to readers at once,
  // written back by write_metadata(). The driver punches their space after.
  virtual void unmap(uint64_t /*first*/, uint64_t /*n*/) {}
  // Host space of units this open unmapped, which reserve() may hand out
  // again: their unmap() has been written back by write_metadata() and no
  // I/O that found the old entries is in flight. Its bytes may not be zeros
  // (a write racing with the discard may have landed after the punch):
  // reserve() zeroes reused space or returns it with fresh = false. Default:
  // the space is not used again.
  virtual void recycle(const HostRun& /*space*/) {}
  // Whether unmapped units are compacted instead of recycled: after the
  // unmap()s of one discard, the data of the last allocated units moves into
  // the space the unmapped ones freed, and the space this leaves at the end
  // goes back to the host. The same answer for the whole open; only writers
  // that can_unmap(). Default: no.
  virtual bool compacts() const { return false; }
  // After the unmap()s of one discard: the moves that pack the allocated
  // units again (none when the unmapped units were the last ones). From now
  // on until cancel_compaction() or end_compaction(),
  // needs_before_unit_write(m.unit) is true for every move m, so that in-place
  // writes into a moving unit wait for the allocation lock and find its new
  // place.
  virtual std::vector<UnitMove> begin_compaction() { return {}; }
  // Every move's data is durable at its `to`: the moving units' entries name
  // it and the unmapped units no longer count as allocated, visible to
  // readers at once, written back by write_metadata(). Their `from` space and
  // the unmapped units' space beyond the allocated ones is vacated: reserve()
  // hands it out again only once this commit is durable.
  virtual void commit_compaction() {}
  // The compaction failed before commit_compaction(): the unmapped units
  // name their space again (the driver zeroed it, as a discard does that
  // does not unmap) and nothing moves.
  virtual void cancel_compaction() {}
  // After commit_compaction(), once no I/O that found the old places is in
  // flight; durable: the commit was written back and flushed. Moved units are
  // written in place without the lock again, and once durable the vacated
  // space at the end goes back to the host (else at close_clean()).
  virtual Task<Status> end_compaction(bool /*durable*/) { co_return Status::ok(); }
  // Whether an in-place write or zeroing into allocated unit `unit` must first
  // go through before_unit_write() (or wait for a compaction that moves it).
  // Called on every in-place write, without the lock: an atomic load at most.
  // The driver then writes under the allocation lock, looking the unit up
  // again there. Default: never.
  virtual bool needs_before_unit_write(uint64_t /*unit*/) const { return false; }
  // Before the first in-place write or zeroing of this open into allocated
  // unit `unit`, durably: what QEMU changes in a unit it writes into (a VHD
  // block's sector bitmap made all ones). Afterwards
  // needs_before_unit_write(unit) is false. Default: nothing.
  virtual Task<Status> before_unit_write(uint64_t /*unit*/) { co_return Status::ok(); }
  // Whether published entries (or other metadata) wait for write_metadata().
  virtual bool dirty() const = 0;
  // Writes back the metadata changed since the last call (the data it points
  // at is durable already). The caller flushes the host afterwards.
  virtual Task<Status> write_metadata() = 0;
  // Whether grow() can change the disk's size (qemu-img resize's rules).
  virtual bool resizable() const { return false; }
  // Grows the disk to new_size guest bytes (larger than today's; resizable()
  // only), durably. Errors: EINVAL for a size the format cannot have.
  virtual Task<Status> grow(uint64_t /*new_size*/) { co_return Status::error(EINVAL, "the format cannot be resized"); }
  // After the last write_metadata() of a clean close, flushed (whether or not
  // anything was changed): clears the dirty or in-use flag, and gives back
  // space a compaction vacated that end_compaction() could not.
  virtual Task<Status> close_clean() { co_return Status::ok(); }
};

// The writer of an image whose every extent is data at a fixed place (a fixed
// VHD): writes go in place, nothing is ever allocated, there is no metadata.
// reserve() refuses with EIO (a map that offers a non-data extent is a bug).
class InPlaceWriter final : public ExtentWriter {
 public:
  uint64_t unit_size() const override { return 512; }
  Task<Result<HostRun>> reserve(uint64_t first, uint64_t n) override;
  void unreserve(const HostRun&) override {}
  void publish(uint64_t, const HostRun&) override {}
  bool dirty() const override { return false; }
  Task<Status> write_metadata() override { co_return Status::ok(); }
};

}  // namespace qcowfs::image
