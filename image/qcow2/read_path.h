// ReadPath: the read mapping of one qcow2 view (the active image or one
// snapshot). Its L2Map is qcow2's ExtentMap (image/extent/map.h): it walks a
// guest range's L1/L2 entries into extents, from an L2 slice in the cache
// without suspending (try_map) or loading the slice (map); reads and
// block_status then go through the shared read engine, ExtentReader
// (image/extent/reader.h): host-contiguous runs in one host read, backing
// reads, zero fill, compressed clusters decompressed once (ClusterCache), all
// sub-reads of a request issued together. What stays qcow2's: legacy AES
// decryption by guest offset (a ReadFilter), corrupt metadata reported with
// the guest offset, the extents' shown host offsets (encrypted images show
// none; ZERO_ALLOC and UNALLOCATED_ALLOC show theirs, as qemu-img map does).
// Qcow2Driver reads and answers block_status through it; Qcow2Writer reads the
// old contents of partly written clusters (copy-on-write) through
// read_unlocked(). Neither calls the other: the writer depends on the read
// path, never the reverse.
//
// The guest range lock lives here because it is what reads and writes share:
// on a writable image (lock_reads()) read() holds the request's clusters
// shared, and every writer request that changes a mapping holds them
// exclusive, so a read never sees a cluster while its mapping changes.
//
// Thread-safety: all methods may be called concurrently from any event-loop
// thread. lock_reads() is called once at open, before any request. The L1
// table is read through L1Table::load (the writer may store an entry
// meanwhile); the image (with its caches, backing driver and cipher set up)
// and the L1 table must outlive the ReadPath.
#pragma once

#include <cstdint>
#include <optional>
#include <span>

#include "image/extent/map.h"
#include "image/extent/reader.h"
#include "image/qcow2/image_state.h"
#include "io/range_lock.h"

namespace qcowfs::image::qcow2 {

// qcow2's ExtentMap over one view's L1 table. An extent runs over the
// entries of one L2 slice while they map the same way (host-contiguous data,
// zeros, unallocated; one compressed cluster at a time), or over a whole
// unallocated L1 entry.
class L2Map final : public ExtentMap {
 public:
  L2Map(Qcow2Image& image, const L1Table& l1, bool snapshot_view)
      : img_(image), l1_(l1), snapshot_view_(snapshot_view) {}

  Result<std::optional<Extent>> try_map(uint64_t guest, uint64_t len) override;
  Task<Result<Extent>> map(uint64_t guest, uint64_t len) override;
  Status decompress(const Extent& e, std::span<const std::byte> stream, std::span<std::byte> out) const override;

 private:
  // Where guest's mapping is: an extent already (no L2 table), or the host
  // offset of the L2 slice holding its entry.
  struct Place {
    std::optional<Extent> extent;
    HostOffset slice = 0;
  };
  Result<Place> place(GuestOffset guest, uint64_t len) const;
  // Where guest's L2 entry sits in its slice and how many bytes of entries
  // from there map [guest, guest + len) inside that slice.
  struct Entries {
    size_t at = 0;
    size_t bytes = 0;
  };
  Entries entries_for(GuestOffset guest, uint64_t len) const;
  // try_map() copies up to this many bytes of entries (64 standard entries: 4 MiB
  // of 64 KiB clusters) instead of pinning the slice.
  static constexpr size_t kCopiedEntryBytes = 512;
  // The extent at guest from `entries`: the L2 entries of guest's slice from
  // guest's own on (at least one; up to the slice's end or past len).
  Result<Extent> in_slice(std::span<const std::byte> entries, GuestOffset guest, uint64_t len) const;
  Extent extent_of(const ClusterRun& r, GuestOffset guest) const;
  Status corrupt(GuestOffset guest, const Status& why) const;

  Qcow2Image& img_;
  const L1Table& l1_;
  const bool snapshot_view_;
};

// Legacy AES (crypt_method 1): data decrypted by guest offset once read.
class LegacyDecrypt final : public ReadFilter {
 public:
  explicit LegacyDecrypt(const Qcow2Image& image) : img_(image) {}
  Task<Status> after_read(uint64_t guest, std::span<std::byte> dst) const override;

 private:
  const Qcow2Image& img_;
};

class ReadPath {
 public:
  ReadPath(Qcow2Image& image, const L1Table& l1, bool snapshot_view);

  // From now on read() takes the guest range lock (a writable image).
  void lock_reads() { lock_reads_ = true; }
  // Guest byte ranges, cluster aligned.
  io::RangeLock& ranges() { return ranges_; }

  // Legacy AES: whole sectors only (Qcow2Driver::read aligns the request).
  Task<Status> read(GuestOffset guest, std::span<std::byte> buf);
  // read()'s one-host-read case (BlockDriver::map_read), holding the range
  // shared as read() does when it can take it at once.
  std::optional<MappedRead> map_read(GuestOffset guest, uint64_t len);
  // read() without the range lock: the caller holds it (copy-on-write source).
  Task<Status> read_unlocked(GuestOffset guest, std::span<std::byte> buf) { return reader_.read(guest, buf); }
  // [guest, guest + len) inside the view, len > 0 (ExtentReader::block_status).
  Task<Result<BlockStatus>> block_status(GuestOffset guest, uint64_t len) { return reader_.block_status(guest, len); }

 private:
  Task<Status> read_locked(GuestOffset guest, std::span<std::byte> buf);

  Qcow2Image& img_;
  L2Map map_;
  LegacyDecrypt decrypt_;
  ExtentReader reader_;
  bool lock_reads_ = false;
  io::RangeLock ranges_;
};

}  // namespace qcowfs::image::qcow2
