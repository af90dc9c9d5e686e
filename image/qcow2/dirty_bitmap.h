// DirtyBitmap: one persistent dirty bitmap in memory (QEMU's BdrvDirtyBitmap
// for one qcow2 bitmap): one bit per `granularity` bytes of the guest disk,
// set by writes, zeroing and discards. Its on-disk form is QEMU's: data
// cluster i of the bitmap holds bits [i * cluster_size * 8, (i + 1) * ...),
// bit k of the bitmap in byte k / 8 at bit k % 8 (little-endian words), the
// tail past the disk's last bit zero.
//
// Thread-safety: none of its own; PersistentBitmaps (bitmaps.h) guards every
// DirtyBitmap it holds with its mutex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace qcowfs::image::qcow2 {

// A dirty guest byte range [offset, offset + length).
struct DirtyRange {
  uint64_t offset = 0;
  uint64_t length = 0;
  bool operator==(const DirtyRange&) const = default;
};

// A run of granules in one state from a given guest offset.
struct DirtyRun {
  uint64_t length = 0;  // bytes (> 0 inside the disk)
  bool dirty = false;
};

class DirtyBitmap {
 public:
  DirtyBitmap(uint64_t size, uint32_t gran_bits);

  uint64_t disk_size() const { return disk_size_; }
  uint32_t granularity_bits() const { return granularity_bits_; }
  uint64_t bit_count() const { return bits_; }

  // Marks every granule [guest, guest + len) touches (clipped at the disk's end).
  void set(uint64_t guest, uint64_t len);
  bool test(uint64_t bit) const { return (words_[bit / 64] >> (bit % 64)) & 1u; }
  void clear();
  // this |= other (same granularity and size; QEMU's merge).
  void merge(const DirtyBitmap& other);
  // New disk size: bits past the old end start clean, bits past the new end go.
  void resize(uint64_t size);
  // The dirty ranges (granule-aligned, the last one clipped at the disk's end).
  std::vector<DirtyRange> dirty_ranges() const;
  bool empty() const;
  // The run from guest (< disk_size) of granules all dirty or all clean, cut
  // at guest + len and at the disk's end (QEMU's bdrv_dirty_bitmap_next_dirty
  // and next_zero from one offset).
  DirtyRun run_at(uint64_t guest, uint64_t len) const;
  // Bytes of the disk the dirty granules cover (QEMU's "count").
  uint64_t dirty_bytes() const;

  // Data cluster `index` of the on-disk form into out (cluster_size bytes);
  // false when it is all zeros (stored as a 0 table entry).
  bool serialize_cluster(uint64_t index, std::span<std::byte> out) const;
  // Loads data cluster `index` from its on-disk bytes (bits past the disk's
  // end ignored).
  void deserialize_cluster(uint64_t index, std::span<const std::byte> in);
  // Sets every bit of data cluster `index` (a table entry's "all ones" flag).
  void fill_cluster(uint64_t index, uint64_t cluster_size);

 private:
  void set_bits(uint64_t first, uint64_t end);  // [first, end) within bits_
  // The first bit in [bit, end) whose value is `value`, else end (end <= bits_).
  uint64_t find_next(uint64_t bit, bool value, uint64_t end) const;
  void trim_tail();

  uint64_t disk_size_;
  uint32_t granularity_bits_;
  uint64_t bits_;
  std::vector<uint64_t> words_;
};

}  // namespace qcowfs::image::qcow2
