// ExtentDriver: the BlockDriver of the formats that map guest ranges onto
// host extents through tables (QED, VDI, Parallels, VHD, VHDX, VMDK). A format
// parses its headers and tables and offers an ExtentMap (image/extent/map.h);
// reads and block_status() go through the shared read engine, ExtentReader
// (image/extent/reader.h), which qcow2 reads through too.
//
// Formats that give an ExtentWriter (image/extent/writer.h) are
// writable: writes into data extents go to the host in place, one host write
// per host-contiguous run; runs of unallocated or zero units get contiguous
// host space from the writer and are written with their copy-on-write head and
// tail (from the backing image, or zeros) in one host write, then published.
// An allocating write plans, reserves its host space and registers itself
// as a batch under one allocation lock, writes its data without it, and
// publishes under it again: the data writes of concurrent allocating
// requests overlap at the host. Batches publish in the order they reserved;
// when one fails, new reservations wait, every later batch is given back
// with it (newest first, so every writer's unreserve() gives back its latest
// reservation) and written again from the start. A request for a unit that
// a batch is allocating waits for that batch, or, where it writes bytes of
// fresh space that batch's host write leaves out, writes them straight into
// that space and completes once that batch is published (it "rides" it).
// Metadata writeback, growth, a compaction and close first let the batches in
// flight publish (quiesce()), so what they write never counts space whose
// data is not written. Writes into data extents take no lock (a writer may
// ask to see the first one into each unit, or hold writes into a unit it
// moves: ExtentWriter::needs_before_unit_write; such writes are planned again
// under the lock). A discard of whole data units of a writer that can_unmap()
// unmaps them under the lock and punches their host space, which is reused
// only after a grace period (image/extent/in_flight.h: reads, in-place writes and
// zeroing then count themselves), or, where the writer compacts (VDI), moves
// the last units' data into their place (compact()). An I/O counted in
// InFlightIo never waits for the allocation lock: it leaves first, since the
// lock's holder may be waiting for the grace period. Without a writer every
// change is refused with EROFS.
//
// Thread-safety: as BlockDriver. ExtentMap::try_map() is called concurrently
// from every event-loop thread and must be thread-safe and never suspend; map()
// may suspend (it loads metadata through a TableCache).
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "image/block_driver.h"
#include "image/extent/cluster_cache.h"
#include "image/extent/map.h"
#include "image/extent/reader.h"
#include "image/extent/writer.h"
#include "image/extent/in_flight.h"
#include "io/sync.h"

namespace qcowfs::image {

// What a format driver hands to ExtentDriver.
struct ExtentImage {
  std::string format;  // QEMU's driver name: "vdi", "vmdk", ...
  std::string path;    // for messages
  uint64_t size = 0;   // guest bytes
  // Every host file the image is made of (the image file first); the map's
  // extents point into them.
  std::vector<std::unique_ptr<io::HostFile>> files;
  std::unique_ptr<ExtentMap> map;
  // nullptr: the image opens read-only. Destroyed before map.
  std::unique_ptr<ExtentWriter> writer;
  std::unique_ptr<BlockDriver> backing;  // nullptr: unallocated reads as zeros
  ImageDetails details;
  // Decompressed size of the compressed units, if the format has them (sizes
  // the ClusterCache); 0: none.
  uint64_t compressed_unit_size = 0;
  // false where QEMU's driver reports no block status (VHDX): every range is
  // then data with no host offset, as `qemu-img map` shows it.
  bool reports_status = true;
};

class ExtentDriver final : public BlockDriver {
 public:
  explicit ExtentDriver(ExtentImage image);
  ~ExtentDriver() override;

  std::string_view format_name() const override { return img_.format; }
  uint64_t size() const override { return size_.load(std::memory_order_acquire); }
  bool read_only() const override { return img_.writer == nullptr; }
  size_t mem_align() const override;

  Task<Status> read(uint64_t off, std::span<std::byte> buf) override;
  std::optional<MappedRead> map_read(uint64_t off, uint64_t len) override;
  Task<Status> write(uint64_t off, std::span<const std::byte> buf) override;
  Task<Status> flush() override;
  Task<Status> discard(uint64_t off, uint64_t len) override;
  Task<Status> write_zeroes(uint64_t off, uint64_t len, bool may_unmap) override;
  Task<Status> truncate(uint64_t new_size) override;
  Task<Result<BlockStatus>> block_status(uint64_t off, uint64_t len) override;
  uint64_t allocated_bytes() const override;
  Task<Status> close() override;
  Task<Status> idle_writeback() override;
  ImageDetails details() const override { return img_.details; }

 private:
  struct SubWrite;
  struct Allocation;
  struct Batch;
  using Event = std::shared_ptr<io::AsyncEvent>;

  // The map's extent at guest, checked: between 1 and len bytes long.
  Task<Result<Extent>> extent_at(uint64_t guest, uint64_t len) { return reader_.extent_at(guest, len); }
  Task<Status> read_tracked(uint64_t off, std::span<std::byte> buf);
  Status refuse_write() const;

  // Write side (driver_write.cc).
  bool reads_zero(const Extent& e, uint64_t guest) const;
  Task<Status> plan_write(uint64_t start, std::span<const std::byte> buf, std::vector<SubWrite>& in_place,
                          std::vector<Allocation>& allocs);
  Task<Status> first_write();
  Task<Status> first_write_locked();
  Task<Status> write_allocating(uint64_t off, std::span<const std::byte> buf);
  Task<Result<Event>> begin_batch(uint64_t off, std::span<const std::byte> buf, Batch& b);
  Task<Status> write_batch(Batch& b);
  void settle();
  void roll_back();
  Event pending(uint64_t first, uint64_t n) const;
  std::pair<std::shared_ptr<Batch>, const Allocation*> pending_allocation(uint64_t first, uint64_t n) const;
  bool can_ride(const Allocation& space, const Allocation& a) const;
  void ride(const Allocation& space, const Allocation& a, std::vector<SubWrite>& out) const;
  Task<void> quiesce(io::AsyncMutex::Guard& lock);
  void open_gate();
  Task<Status> reserve_all(std::vector<Allocation>& allocs);
  Task<Status> fill_cow(Allocation& a);
  Task<Status> write_allocation(Allocation& a);
  Task<Status> write_prefixed(Allocation& a);
  Task<Status> write_in_place(const std::vector<SubWrite>& in_place);
  bool needs_before_unit_writes(uint64_t guest, uint64_t len) const;
  Task<Status> before_unit_writes(uint64_t guest, uint64_t len);
  Task<Result<uint64_t>> write_zero_extent(const Extent& e, uint64_t guest, bool unmap, InFlightIo::Ticket& ticket);
  Task<Status> zero_data(const Extent& e, uint64_t guest, uint64_t len, bool unmap, InFlightIo::Ticket& ticket);
  Task<Status> zero_data_locked(uint64_t guest, uint64_t len, bool unmap);
  static Task<Status> zero_host(io::HostFile& file, uint64_t host, uint64_t len, bool unmap);
  Task<Status> write_zero_buffer(uint64_t guest, uint64_t len);
  Task<Status> zero_units(uint64_t guest, uint64_t len, bool unmap);
  Task<Result<uint64_t>> unmap_extent(const Extent& e, uint64_t guest, InFlightIo::Ticket& ticket);
  Task<Status> unmap_units(uint64_t first, uint64_t last);
  Task<Status> unmap_each(uint64_t first, uint64_t last, std::vector<HostRun>& runs, std::vector<uint64_t>& changed);
  Task<Status> punch_unmapped(const std::vector<HostRun>& runs);
  Task<Status> compact(const std::vector<HostRun>& unmapped);
  Task<Status> copy_units(const std::vector<UnitMove>& moves);
  Task<void> grace_period(uint64_t epoch);
  void recycle_drained();
  InFlightIo::Ticket track();
  Task<Status> flush_files();
  Task<Status> writeback();

  // Host space of units unmapped in this open, until recycle_drained() gives
  // it back to the writer (alloc_ held).
  struct Unmapped {
    HostRun space;
    uint64_t epoch = 0;    // InFlightIo::epoch() after the unmap
    bool written = false;  // a write_metadata() since the unmap succeeded
  };

  ExtentImage img_;
  ClusterCache units_;
  ExtentReader reader_;  // over img_.map, img_.backing and units_
  io::AsyncMutex alloc_;              // allocation, publishing, metadata writeback
  io::AsyncMutex flushing_;           // one flush at a time
  bool changed_ = false;              // ExtentWriter::begin_change() done (alloc_ held)
  std::atomic<bool> written_{false};  // ExtentWriter::before_first_write() done
  bool closed_ = false;
  std::atomic<uint64_t> size_;  // guest bytes: img_.size, then what truncate() grew it to
  // The writer unmaps (ExtentWriter::can_unmap): lock-free I/O is tracked.
  const bool unmaps_;
  InFlightIo in_flight_;
  std::vector<Unmapped> unmapped_;  // alloc_ held
  // Allocating writes in flight, in the order they reserved (alloc_ held).
  std::deque<std::shared_ptr<Batch>> batches_;
  int quiescers_ = 0;  // quiesce() calls waiting, or holding the lock with nothing in flight
  Event gate_;         // while new batches wait (a failure, a quiesce()); set when they may go on
  Event drained_;      // while someone waits for batches_ to empty; set when it is
};

// For a format whose image is one host file (QED, VDI, Parallels): when a
// read-write open made its writer, img takes it, or the open fails with the
// Status the writer's making returned.
Status take_writer(ExtentImage& img, Result<std::unique_ptr<ExtentWriter>> writer);

// The end of opening such a format when nothing is left to open after the
// writer (VDI, Parallels: no backing file): img takes its map and its file
// and becomes the driver.
std::unique_ptr<BlockDriver> one_file_driver(ExtentImage img, std::unique_ptr<ExtentMap> map,
                                             std::unique_ptr<io::HostFile> file);

}  // namespace qcowfs::image
