// Qcow2Writer: the write path of one writable qcow2 image (the active image,
// never a snapshot view). Qcow2Driver forwards write, flush, discard,
// write_zeroes, truncate and close here.
//
// Writes. A request is mapped cluster by cluster under the metadata lock:
//   overwrite  an allocated COPIED cluster (refcount 1) whose touched
//              subclusters are allocated: written in place, no metadata change;
//   update     an allocated COPIED cluster that needs its L2 entry changed
//              (ZERO_ALLOC, or unallocated/zero subclusters with extended L2):
//              written in place, then the entry is updated;
//   allocate   anything else (unallocated, zero, compressed, shared): all such
//              clusters of the request get ONE contiguous run of new host
//              clusters; the old cluster's reference is dropped after the new
//              L2 entry is on disk.
// Partial clusters (partial subclusters with extended L2) are completed with
// their old contents (backing file, zero, compressed or shared data) read
// first, and the whole run goes out as one writev per host-contiguous range:
// head COW + guest data + tail COW. Host I/O runs without the metadata lock.
// Exception: a cluster allocated past everything the allocator has handed out
// (so past the host file's end at open, never written since) reads as zeros;
// when the COW regions read as zeros too (no backing data, no compressed or
// shared source), only the request is written, padded to the host alignment,
// and the host space is preallocated ahead (zero-reading) in kPreallocBytes
// steps so those small writes do not each extend the file; close() trims what
// was not used.
//
// Concurrency: every request holds a guest range lock on its clusters. Pure
// overwrites hold it shared and run in parallel; anything that changes the
// mapping holds it exclusive, so two requests touching the same unallocated
// cluster are ordered (the later one maps after the earlier one's L2 update)
// while unrelated clusters proceed in parallel. Readers take it shared.
//
// Metadata reaches the disk through MetadataTracker/write_batch (see
// image/qcow2/metadata.h) on flush(), close(), idle_writeback() and whenever
// more than kMaxDirtySlices L2 slices or kMaxDirtyBlocks refcount blocks are dirty.
//
// Lock order: guest range lock -> writeback lock -> metadata lock. The
// metadata lock guards changes to the L1 table and L2 slice contents and all
// of the refcounts, allocator and tracker; it is held across metadata reads
// (cache misses) and the few metadata writes that must happen in place (new
// L2 tables), never across guest data I/O. Pure overwrites map without it
// (their shared range lock excludes every change to their clusters' entries).
//
// Thread-safety: all methods may be called concurrently from any event-loop thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "image/block_driver.h"
#include "image/qcow2/alloc.h"
#include "image/qcow2/driver.h"
#include "image/qcow2/layout.h"
#include "image/qcow2/metadata.h"
#include "image/qcow2/refcount.h"
#include "io/range_lock.h"
#include "io/sync.h"

namespace qcowfs::image::qcow2 {

class Qcow2Writer {
 public:
  // Reads guest bytes with the current mapping, without taking range locks
  // (the caller holds them): the copy-on-write source.
  using ReadFn = std::function<Task<Status>(uint64_t off, std::span<std::byte> dst)>;

  static constexpr size_t kMaxDirtySlices = 512;
  static constexpr size_t kMaxDirtyBlocks = 64;
  // Host space allocated ahead of small writes into fresh clusters.
  static constexpr uint64_t kPreallocBytes = 4ull << 20;

  // Prepares image (opened writable) for writing: loads the refcount table,
  // and rebuilds the refcounts first when the dirty bit is set.
  static Task<Result<std::unique_ptr<Qcow2Writer>>> open(Qcow2Image& image, L1Table& l1, ReadFn read_old,
                                                         const ImageOptions& opts);
  Qcow2Writer(Qcow2Image& image, L1Table& l1, ReadFn read_old, bool discard_unmap);

  uint64_t size() const { return size_.load(std::memory_order_acquire); }
  io::RangeLock& ranges() { return ranges_; }

  Task<Status> write(uint64_t off, std::span<const std::byte> buf);
  Task<Status> flush();
  Task<Status> discard(uint64_t off, uint64_t len);
  Task<Status> write_zeroes(uint64_t off, uint64_t len, bool may_unmap);
  Task<Status> truncate(uint64_t new_size);
  Task<Status> idle_writeback();
  Task<Status> close();

  // For tests: the refcount table and allocator (use with no request in flight).
  RefcountTable& refcounts() { return *refcounts_; }
  ClusterAllocator& allocator() { return *alloc_; }

 private:
  enum class Kind : uint8_t { overwrite, update, allocate };
  enum class ZeroMode : uint8_t { discard, zero_unmap, zero_keep };
  struct Slot;
  struct Plan;

  Task<Status> prepare();
  // Corruption found while writing (as QEMU's qcow2_signal_corruption): sets
  // the corrupt bit on disk and fails this and every later change with EIO.
  Task<Status> check_corruption(Status st);
  Status corrupt_error() const;
  Status corruption(std::string what);
  // A fresh run must not overlap metadata we know about (refcount 0 there
  // means the refcounts are wrong).
  Status check_fresh(uint64_t first_cluster, uint64_t n);
  Task<Status> set_incompatible_bits(uint64_t bits);
  Task<Status> repair_refcounts();
  Task<Status> clear_autoclear_features();

  Task<Status> write_once(uint64_t off, std::span<const std::byte> buf, bool exclusive, bool* retry_exclusive);
  Task<Status> map(uint64_t off, uint64_t len, bool exclusive, Plan& plan);
  Task<Status> classify(Slot& s, bool exclusive);
  Task<Status> allocate_run(Plan& plan);
  bool old_reads_zero(const Slot& s) const;
  Task<Status> preallocate(uint64_t zero_from, uint64_t run_end);
  Task<Status> trim_preallocation();
  void write_only_request(Slot& s) const;
  Task<Result<uint64_t>> ensure_l2(uint64_t l1_index);
  Task<Result<L2Cache::Ref>> slice_for(uint64_t l2_offset, uint64_t l2_index, size_t* index_in_slice);
  Task<Status> fill_cow(Plan& plan, uint64_t off, std::span<const std::byte> buf);
  Task<Status> write_data(Plan& plan, uint64_t off, std::span<const std::byte> buf);
  const MetadataRange* data_overlap(uint64_t host, uint64_t len) const;
  Task<Status> data_overlap_error(uint64_t off, uint64_t host, const MetadataRange& m);
  Task<Status> commit(Plan& plan);
  Task<Status> undo(Plan& plan);
  Task<Status> set_l2(L2Cache::Ref& slice, size_t index, uint64_t entry, uint64_t bitmap);
  void release_old(uint64_t entry);

  Task<Status> zero_clusters(uint64_t first, uint64_t end, ZeroMode mode, std::vector<uint64_t>* need_data);
  Task<Status> zero_range(uint64_t off, uint64_t len, ZeroMode mode);
  Task<Status> write_zero_bytes(uint64_t off, uint64_t len);

  Task<Status> writeback();
  Task<Status> writeback_locked();
  Task<Status> maybe_writeback();
  void note_dirty_amount();  // metadata lock held
  Task<Status> grow_refcount_table();
  // Runs step with the metadata lock held in m, again after growing the
  // refcount table (lock dropped meanwhile) each time it answers EAGAIN. A
  // step's error goes through check_corruption (lock dropped first); an error
  // growing the table is returned as it is.
  Task<Status> with_refcount_room(io::AsyncMutex::Guard& m, const std::function<Task<Status>()>& step);
  Task<Status> grow_l1(uint64_t entries, uint64_t new_size);
  Task<Status> write_header_bytes(uint64_t off, std::span<const std::byte> bytes);
  bool has_backing() const;

  Qcow2Image& img_;
  L1Table& l1_;
  ReadFn read_old_;
  const bool discard_unmap_;
  std::atomic<uint64_t> size_;

  io::AsyncMutex writeback_lock_;
  io::RangeLock ranges_;  // guest byte ranges, cluster aligned
  io::AsyncMutex meta_;
  // Guarded by meta_:
  std::unique_ptr<RefcountTable> refcounts_;
  std::unique_ptr<ClusterAllocator> alloc_;
  MetadataTracker tracker_;
  std::atomic<bool> prepared_{false};
  std::atomic<bool> writeback_due_{false};  // more dirty metadata than the bounds allow
  uint64_t prealloc_end_ = 0;  // host bytes below it are allocated (preallocated) space
  bool set_dirty_bit_ = false;  // we set the dirty bit (lazy refcounts): clear at close
  bool closed_ = false;
  std::atomic<bool> corruption_seen_{false};
  std::atomic<bool> marked_corrupt_{false};
};

}  // namespace qcowfs::image::qcow2
