// PersistentBitmaps: the persistent dirty bitmaps of one open qcow2 image, as
// QEMU 7.2 keeps them (block/qcow2-bitmap.c). load() reads and checks the
// bitmap directory and the tables (bitmap_dir.h), which every open does (a
// directory QEMU refuses makes the open fail); on a writable open it also
// reads the data of every bitmap not in use. The writer then:
//   - before the first change marks the loaded bitmaps IN_USE on disk
//     (Qcow2Writer::mark_bitmaps_in_use, writer_bitmaps.cc),
//   - sets the bits of the enabled ones for every write, write-zeroes and
//     discard (note_write),
//   - on close stores them (new tables and data, the old ones freed) with
//     IN_USE cleared (Qcow2Writer::store_bitmaps).
// A bitmap found IN_USE at open was not stored by whoever had it open: as in
// QEMU it is inconsistent, never loaded, updated or stored, kept on disk as
// it is (info shows "in-use"; `qcowfs bitmap --remove` drops it). Disabled
// bitmaps are loaded and stored again with the same bits, as QEMU does.
//
// dirty_ranges(), run_at() and summaries() are the query API for views of a
// bitmap (what changed since the bitmap was made, in guest byte ranges). A
// read-only open of the active image loads the bits too (QEMU loads them
// read-only): they never change then.
//
// Thread-safety: every member function is safe to call concurrently (one
// mutex, never held across I/O); load() is a plain factory. note_write()
// returns without the mutex when no bitmap is enabled and loaded (an atomic
// every change of the set or of a flag recomputes under the mutex).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "image/qcow2/bitmap_dir.h"
#include "image/qcow2/dirty_bitmap.h"
#include "image/qcow2/header.h"
#include "io/host_file.h"
#include "io/status.h"
#include "io/task.h"

namespace qcowfs::image::qcow2 {

// Bytes of bitmap data one open image may hold in memory (hostile images
// could otherwise ask for 512 MiB per bitmap).
inline constexpr uint64_t kMaxLoadedBitmapBytes = 1ull << 30;

// One bitmap of the directory, with its bits when loaded.
struct TrackedBitmap {
  BitmapDirEntry entry;                // flags as they are (or will be) on disk
  std::shared_ptr<DirtyBitmap> bits;   // null: inconsistent (in use at open) or not loaded
  std::vector<BitmapHostRange> held;   // its table and data clusters on disk (freed when stored or removed)
};

// One bitmap as a view lists it.
struct BitmapSummary {
  BitmapDirEntry entry;
  bool loaded = false;       // false: inconsistent (or its data not read)
  uint64_t dirty_bytes = 0;  // disk bytes its dirty granules cover
};

// What the writer stores at close: copies taken under the mutex.
struct BitmapStoreSet {
  std::vector<TrackedBitmap> bitmaps;  // directory order; bits are private copies
  std::vector<BitmapHostRange> free_after;  // removed bitmaps' clusters and the old directory
};

class PersistentBitmaps {
 public:
  // The bitmaps of the image of header h in f (none without the extension or
  // without the autoclear bit: QEMU ignores a stale extension). load_data:
  // read the bits of every bitmap not in use (writable opens).
  static Task<Result<std::unique_ptr<PersistentBitmaps>>> load(io::HostFile& f, const Header& h, bool load_data);

  bool empty() const;
  // Whether some bitmap has loaded bits (the writer marks and stores those).
  bool has_loaded() const;
  std::vector<BitmapDirEntry> entries() const;

  // Sets the bits of every enabled, loaded bitmap for [guest, guest + len).
  void note_write(uint64_t guest, uint64_t len);
  // The dirty ranges of bitmap `name`; nullopt when there is no such loaded bitmap.
  std::optional<std::vector<DirtyRange>> dirty_ranges(std::string_view name) const;
  // The run of loaded bitmap `name` from guest (DirtyBitmap::run_at); nullopt
  // when there is no such loaded bitmap.
  std::optional<DirtyRun> run_at(std::string_view name, uint64_t guest, uint64_t len) const;
  std::vector<BitmapSummary> summaries() const;

  // Marks every loaded bitmap IN_USE in memory; returns the directory to write.
  std::vector<BitmapDirEntry> mark_in_use();
  // Resize (qemu-img resize with bitmaps): ENOTSUP with QEMU's message when a
  // bitmap is inconsistent or not loaded; else every loaded bitmap follows.
  Status check_resize() const;
  void resize(uint64_t disk_size);

  // `qcowfs bitmap` operations (QEMU's block-dirty-bitmap-* semantics).
  Status add(const std::string& name, uint64_t granularity, bool enabled, uint64_t disk_size, uint32_t cluster_bits);
  Status remove(const std::string& name);
  // QEMU's free_bitmap_clusters reads a removed bitmap's table then, in use or
  // not: the table and data clusters of inconsistent bitmap `name` (never read
  // at open), checked as at open and against the other bitmaps' clusters;
  // empty when there is no such inconsistent bitmap. hold() records them for
  // remove() to free.
  Task<Result<std::vector<BitmapHostRange>>> read_unloaded_table(io::HostFile& f, const Header& h,
                                                                 const std::string& name) const;
  void hold(const std::string& name, std::vector<BitmapHostRange> ranges);
  Status clear(const std::string& name);
  Status set_enabled(const std::string& name, bool enabled);
  // dst |= src (src: a bitmap of this image, or bits from another image).
  Status merge(const std::string& dst, const DirtyBitmap& src);
  // A copy of loaded bitmap `name`'s bits.
  Result<DirtyBitmap> bits_of(const std::string& name) const;

  BitmapStoreSet store_set() const;
  // After a successful store: the directory on disk is `stored` at dir.
  void stored(std::vector<TrackedBitmap> done, BitmapHostRange dir);
  const BitmapHostRange& directory() const { return dir_; }
  // Every host range the bitmaps hold on disk (directory in whole clusters).
  std::vector<BitmapHostRange> held_ranges(uint64_t cluster_size) const;
  bool changed() const;  // loaded bitmaps or removals to store

 private:
  // Recomputes noting_ from bitmaps_; called with mu_ held after every change
  // of the set, of a bitmap's bits pointer or of its flags.
  void recount();
  TrackedBitmap* find(const std::string& name);
  const TrackedBitmap* find(const std::string& name) const;
  Status find_consistent(const std::string& name, TrackedBitmap** out);

  mutable std::mutex mu_;
  std::vector<TrackedBitmap> bitmaps_;      // directory order
  std::vector<BitmapHostRange> removed_;    // clusters of removed bitmaps, freed at the next store
  bool modified_ = false;                   // an operation changed the set or a flag
  BitmapHostRange dir_;                     // the directory on disk (length 0: none)
  // Whether some bitmap is loaded and enabled, i.e. note_write() has bits to
  // set. Written under mu_ (recount()), read by note_write() without it.
  std::atomic<bool> noting_{false};
};

}  // namespace qcowfs::image::qcow2
