// Qcow2Writer: the write path of one writable qcow2 image (the active image,
// never a snapshot view). Qcow2Driver forwards write, flush, discard,
// write_zeroes, truncate, idle_writeback and close here.
//
// One class, its member functions defined in one file per job:
//   writer_open.cc       open, prepare (header feature bits), repair, close, corruption
//   writer_map.cc        mapping and allocation: map, classify, allocate_run, preallocate
//   writer_data.cc       write(): data and copy-on-write, the overlap check
//   writer_commit.cc     L2 / refcount changes of a written request, and their undo
//   writer_zero.cc       discard and write_zeroes
//   writer_compress.cc   compressed writes (compress=on)
//   writer_resize.cc     truncate, L1 growth
//   writer_writeback.cc  write-back scheduling, refcount table growth
// (request-local types in writer_plan.h; design in image/qcow2/DESIGN.md).
//
// Writes. A request is mapped cluster by cluster:
//   overwrite  an allocated COPIED cluster (refcount 1) whose touched
//              subclusters are allocated: written in place, no metadata change;
//   update     an allocated COPIED cluster that needs its L2 entry changed
//              (ZERO_ALLOC, or unallocated/zero subclusters with extended L2):
//              written in place, then the entry is updated;
//   allocate   anything else (unallocated, zero, compressed, shared): all such
//              clusters of the request get ONE contiguous run of new host
//              clusters; the old cluster's reference is dropped after the new
//              L2 entry is on disk.
// A request first maps under a shared range lock without the metadata lock;
// when every cluster is an overwrite it is written at once. Otherwise it maps
// again under an exclusive range lock and the metadata lock (the first pass
// stops at the first cluster that is not an overwrite), allocates, writes and
// commits. Partial clusters (partial subclusters with extended L2) are
// completed with their old contents, read through the ReadPath (backing file,
// zero, compressed or shared data), and the whole run goes out as one writev
// per host-contiguous range: head COW + guest data + tail COW. Host I/O runs
// without the metadata lock.
// Exception: a cluster allocated past everything the allocator has handed out
// (so past the host file's end at open, never written since) reads as zeros;
// when the COW regions read as zeros too (no backing data, no compressed or
// shared source), only the request is written, padded to the host alignment,
// and the host space is preallocated ahead (zero-reading) in kPreallocBytes
// steps so those small writes do not each extend the file; close() trims what
// was not used.
//
// Compressed writes (compress=on, image/qcow2/DESIGN.md "Compressed writes"):
// a cluster the request writes whole whose entry names no host cluster
// (unallocated or zero: nothing to copy, nothing to overwrite) is compressed
// instead, all such clusters of a request in parallel on the worker pool with
// no lock but the range lock, then packed byte by byte as QEMU packs them
// (ClusterAllocator::allocate_bytes) and written as one host write per
// host-contiguous run; their L2 entries are set in the same commit pass as the
// request's other clusters. A cluster that does not shrink below a cluster is
// allocated and written as any other.
//
// Concurrency: every request holds the ReadPath's guest range lock on its
// clusters. Pure overwrites hold it shared and run in parallel; anything that
// changes the mapping holds it exclusive, so two requests touching the same
// unallocated cluster are ordered (the later one maps after the earlier one's
// L2 update) while unrelated clusters proceed in parallel. Reads take it shared.
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
#include <string>
#include <utility>
#include <vector>

#include "image/block_driver.h"
#include "image/qcow2/alloc.h"
#include "image/qcow2/bitmaps.h"
#include "image/qcow2/image_state.h"
#include "image/qcow2/metadata.h"
#include "image/qcow2/read_path.h"
#include "image/qcow2/refcount.h"
#include "io/buffer.h"
#include "io/range_lock.h"
#include "io/sync.h"

namespace qcowfs::image::qcow2 {

class Qcow2Writer {
 public:
  static constexpr size_t kMaxDirtySlices = 512;
  static constexpr size_t kMaxDirtyBlocks = 64;
  // Host space allocated ahead of small writes into fresh clusters.
  static constexpr uint64_t kPreallocBytes = 4ull << 20;

  // The writer's lifecycle. Transitions:
  //   opened -> clean | dirty   prepare(), before the first change
  //   any    -> closed          close(), after everything is written back
  // Corruption (image/qcow2/corruption.h) is separate: it refuses writes in
  // any state, and close() still writes back what it can.
  enum class State : uint8_t {
    opened,  // refcounts loaded; header as found at open
    clean,   // prepared; the dirty bit, if set, is not ours to clear
    dirty,   // prepared and we set the dirty bit (lazy refcounts): close() clears it
    closed,  // metadata written back, preallocation trimmed, our dirty bit cleared
  };

  // Prepares image (opened writable) for writing: loads the refcount table,
  // and rebuilds the refcounts first when the dirty bit is set. l1 and reads
  // (the view's read path, whose range lock the writer shares) must outlive it.
  static Task<Result<std::unique_ptr<Qcow2Writer>>> open(Qcow2Image& image, L1Table& l1, ReadPath& reads,
                                                         const ImageOptions& opts);
  Qcow2Writer(Qcow2Image& image, L1Table& l1, ReadPath& reads, bool discard_unmap, bool compress);

  uint64_t size() const { return size_.load(std::memory_order_acquire); }
  State state() const { return state_.load(std::memory_order_acquire); }

  Task<Status> write(GuestOffset guest, std::span<const std::byte> buf);
  Task<Status> flush();
  Task<Status> discard(GuestOffset guest, uint64_t len);
  Task<Status> write_zeroes(GuestOffset guest, uint64_t len, bool may_unmap);
  Task<Status> truncate(uint64_t new_size);
  Task<Status> idle_writeback();
  Task<Status> close();

  // The image's persistent dirty bitmaps (image/qcow2/bitmaps.h): never null
  // after open; empty without the bitmaps extension.
  PersistentBitmaps& bitmaps() { return *bitmaps_; }
  // Before a change that is not a guest write (`qcowfs bitmap` operations):
  // the same preparation as the first write (bitmaps marked in use).
  Task<Status> prepare_for_change() { return prepare(); }
  // Before `qcowfs bitmap --remove` of an inconsistent bitmap: its table is
  // read so that the removal frees its clusters, as QEMU's does; a table
  // that cannot be read, or whose clusters overlap other metadata, is left
  // alone (its clusters leak, as QEMU leaves them), with a warning.
  Task<void> adopt_bitmap_table(const std::string& name);

  // For tests: the refcount table and allocator (use with no request in flight).
  RefcountTable& refcounts() { return *refcounts_; }
  ClusterAllocator& allocator() { return *alloc_; }

 private:
  // compressed: an allocate slot written whole into a cluster that names no
  // host cluster, stored compressed (compress=on).
  enum class Kind : uint8_t { overwrite, update, allocate, compressed };
  enum class ZeroMode : uint8_t { discard, zero_unmap, zero_keep };
  struct Slot;
  struct Plan;
  struct ZeroTarget;
  struct HostWrite;

  // ---- open, header feature state, corruption (writer_open.cc) ----
  Task<Status> load_refcounts();
  Task<Status> prepare();
  Task<Status> prepare_locked();
  Task<Status> set_incompatible_bits(uint64_t bits);
  Task<Status> write_header_bytes(uint64_t header_offset, std::span<const std::byte> bytes);
  // One 8-byte big-endian header field (autoclear, incompatible features, size), then a flush.
  Task<Status> write_header_u64(uint64_t header_offset, uint64_t value);
  Task<Status> repair_refcounts();
  Task<Status> clear_autoclear_features(bool keep_bitmaps);
  Task<Status> write_back_all();
  Task<Status> close_locked();
  Task<Status> clear_dirty_bit();
  // Corrupt metadata found by this request: logs it, records it in the image's
  // Corruption and returns EIO.
  Status corruption(std::string what) const;
  // After a failed step: when corruption was found (here or by the refcount
  // table), marks the image corrupt once and returns EIO; else returns st.
  Task<Status> check_corruption(Status st);
  bool has_backing() const;

  // ---- persistent bitmaps (writer_bitmaps.cc) ----
  Task<Status> load_bitmaps();
  void note_guest_change(GuestOffset guest, uint64_t len);
  Task<Status> write_autoclear(uint64_t bits);
  Task<Status> mark_bitmaps_in_use();
  Task<Result<HostOffset>> allocate_bitmap_clusters(uint64_t n);
  Task<Status> write_bitmap_clusters(HostOffset host, std::span<const std::byte> bytes);
  Task<Status> store_bitmap(TrackedBitmap& t, std::vector<BitmapHostRange>& fresh);
  Task<Status> write_bitmaps_extension(uint32_t nb_bitmaps, const BitmapHostRange& dir);
  Task<Status> release_bitmap_ranges(const std::vector<BitmapHostRange>& ranges);
  Task<Status> store_bitmaps();

  // ---- mapping and allocation (writer_map.cc) ----
  // Maps a pure overwrite without the metadata lock: false (plan unusable)
  // as soon as a cluster needs more than an in-place write.
  Task<Result<bool>> map_overwrite(GuestOffset guest, uint64_t len, Plan& plan);
  // Maps for a mapping change (exclusive range lock, metadata lock held):
  // creates or copies L2 tables as needed.
  Task<Status> map_exclusive(GuestOffset guest, uint64_t len, Plan& plan);
  // Empties plan for the request [guest, guest + len), room made for its
  // slots; returns the first and last guest clusters it touches.
  std::pair<GuestCluster, GuestCluster> start_plan(GuestOffset guest, uint64_t len, Plan& plan) const;
  Slot request_slot(GuestCluster gc, GuestOffset guest, uint64_t len) const;
  Task<Status> load_entry(Plan& plan, Slot& s, HostOffset l2_table);
  HostOffset slice_of(const Slot& s, HostOffset l2_table) const;
  bool pin_cached_slice(Plan& plan, HostOffset slice_host) const;
  Status take_entry(Plan& plan, Slot& s) const;
  bool read_cached_entry(Slot& s, HostOffset slice_host) const;
  Result<HostOffset> l2_table_of(uint64_t l1_entry, uint64_t l1_index) const;
  Status classify(Slot& s) const;
  void classify_owned(Slot& s, HostOffset host) const;
  void classify_allocate(Slot& s, bool allocated, bool compressed) const;
  Task<Status> allocate_run(Plan& plan);
  bool old_reads_zero(const Slot& s) const;
  void write_only_request(Slot& s) const;
  Task<Status> preallocate(HostCluster zero_from_hc, HostCluster end_hc);
  Task<Status> trim_preallocation();
  Task<Result<HostOffset>> ensure_l2(uint64_t l1_index);
  Task<Status> copy_l2_table(HostOffset old_table, HostOffset new_table);
  Task<Result<TableCache::Ref>> slice_for(HostOffset l2_table, uint64_t l2_index, size_t* index_in_slice);
  // A fresh run must not overlap metadata we know about (refcount 0 there
  // means the refcounts are wrong).
  Status check_fresh(HostCluster first_hc, uint64_t n) const;

  // ---- data and copy-on-write (writer_data.cc) ----
  // Writes buf when every cluster is a pure overwrite: false when it was not.
  Task<Result<bool>> write_in_place(GuestOffset guest, std::span<const std::byte> buf);
  // Writes buf with mapping changes (allocation, L2 updates).
  Task<Status> write_allocating(GuestOffset guest, std::span<const std::byte> buf);
  Task<Status> fill_cow(Plan& plan, GuestOffset guest, std::span<const std::byte> buf);
  Task<Status> write_data(Plan& plan, GuestOffset guest, std::span<const std::byte> buf);
  Task<Status> write_runs(Plan& plan, GuestOffset guest, std::span<const std::byte> buf);
  std::vector<HostWrite> host_writes(Plan& plan, GuestOffset guest, std::span<const std::byte> buf) const;
  const MetadataRange* data_overlap(HostOffset host, uint64_t len) const;
  Task<Status> data_overlap_error(GuestOffset guest, HostOffset host, const MetadataRange& m);

  // ---- commit of L2 / refcount changes (writer_commit.cc; metadata lock held) ----
  Task<Status> commit(Plan& plan);
  Task<Status> undo(Plan& plan);
  Task<Status> set_l2(TableCache::Ref& slice, size_t index, uint64_t entry, uint64_t bitmap);
  void release_old(uint64_t entry);

  // ---- compressed writes (writer_compress.cc) ----
  // compress=on is refused where QEMU cannot write compressed clusters either
  // (external data file) and on encrypted images.
  static Status check_compress_allowed(const Qcow2Image& image);
  // Marks the slots to store compressed; whether there is any.
  bool mark_compressible(Plan& plan) const;
  bool whole_cluster_write(const Slot& s) const;
  // Compresses the marked slots (no metadata lock), then allocates the
  // request's host run and places the streams (metadata lock).
  Task<Status> compress_and_allocate(Plan& plan, GuestOffset guest, std::span<const std::byte> buf);
  Task<Status> compress_slots(Plan& plan, GuestOffset guest, std::span<const std::byte> buf);
  Task<Status> place_compressed(Plan& plan);
  // The streams of the plan as host-contiguous runs, each in one buffer of `bufs`.
  std::vector<HostWrite> compressed_writes(Plan& plan, std::vector<io::AlignedBuffer>& bufs) const;
  // Drops the references a placed stream took.
  Task<Status> release_stream(const Slot& s);
  // The host file ends inside a 512-byte sector when the last stream does:
  // extended to a whole sector at close, as qemu-img convert -c leaves it.
  Task<Status> align_file_end();

  // ---- zero and discard (writer_zero.cc) ----
  Task<Status> zero_range(GuestOffset guest, uint64_t len, ZeroMode mode);
  Task<Status> zero_clusters_locked(GuestCluster first_gc, GuestCluster end_gc, ZeroMode mode,
                                    std::vector<GuestCluster>& need_data);
  Task<Status> zero_clusters(GuestCluster first_gc, GuestCluster end_gc, ZeroMode mode,
                             std::vector<GuestCluster>* need_data);
  Task<Status> zero_cluster(GuestCluster gc, ZeroMode mode, std::vector<GuestCluster>* need_data);
  ZeroTarget zero_target(const Slot& s, ZeroMode mode) const;
  Task<Status> write_zero_bytes(GuestOffset guest, uint64_t len);
  Task<Status> write_zero_clusters(const std::vector<GuestCluster>& gcs);

  // ---- resize (writer_resize.cc) ----
  Task<Status> check_tail_unallocated(uint64_t new_size);
  Task<Status> write_size(uint64_t new_size);
  Task<Status> grow_l1(uint64_t entries, uint64_t new_size);
  Task<Result<HostCluster>> allocate_l1(uint64_t clusters);
  Task<Status> write_l1(HostCluster first_hc, uint64_t clusters, uint64_t entries, uint64_t new_size);
  Task<Status> switch_l1(HostCluster first_hc, uint64_t entries, uint64_t new_size);

  // ---- write-back scheduling (writer_writeback.cc) ----
  Task<Status> writeback();
  Task<Status> writeback_locked();
  Task<Status> apply_releases(const WritebackBatch& batch);
  Task<Status> discard_freed(std::vector<HostCluster> freed);
  Task<Status> maybe_writeback();
  void note_dirty_amount();  // metadata lock held
  Task<Status> grow_refcount_table();
  // Runs step with the metadata lock held in m, again after growing the
  // refcount table (lock dropped meanwhile) each time it answers EAGAIN. A
  // step's error goes through check_corruption (lock dropped first); an error
  // growing the table is returned as it is.
  Task<Status> with_refcount_room(io::AsyncMutex::Guard& m, const std::function<Task<Status>()>& step);

  Qcow2Image& img_;
  L1Table& l1_;
  ReadPath& reads_;  // copy-on-write source; owns the guest range lock
  const bool discard_unmap_;
  const bool compress_;  // compress=on
  std::atomic<uint64_t> size_;
  std::atomic<State> state_{State::opened};  // changes under meta_

  io::AsyncMutex writeback_lock_;
  io::AsyncMutex meta_;
  // Guarded by meta_:
  std::unique_ptr<RefcountTable> refcounts_;
  std::unique_ptr<ClusterAllocator> alloc_;
  MetadataTracker tracker_;
  std::atomic<bool> writeback_due_{false};  // more dirty metadata than the bounds allow
  HostOffset prealloc_end_ = 0;  // host bytes below it are allocated (preallocated) space
  std::unique_ptr<PersistentBitmaps> bitmaps_;  // internally synchronised
};

}  // namespace qcowfs::image::qcow2
