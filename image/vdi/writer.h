// VdiWriter: the ExtentWriter of a VDI image opened read-write, as QEMU 7.2's
// vdi_co_pwritev() allocates: a new block is data block blocks_allocated (the
// next after the last, at offset_data + index * block_size), the block map
// entry names it and the header's blocks_allocated counts it. The header and
// the block map (sector-rounded) are kept in memory; write_metadata() writes
// back what changed. When the block map follows the header closely (every
// image qemu-img and VirtualBox make) the header and the changed part of the
// block map go out in one host write, so that a crash never leaves a block map
// and a blocks_allocated that disagree (qemu-img check's "allocated blocks
// mismatch"); otherwise two writes, ordered so that no entry on disk is ever
// at or past the blocks_allocated on disk: the header first when the count
// grew (as QEMU writes), the block map first when it shrank. VDI has no dirty
// flag. The first block of an image with none moves a data area that starts
// off 1 MiB (qemu-img's, at 4608 bytes for small disks) to the next 1 MiB
// boundary, as VirtualBox aligns it (align_data_area()), written back with
// that header.
//
// Discard (dynamic images; a static image keeps every block, zeroed in
// place): whole blocks become discarded (VDI_DISCARDED, reads as zeros) and
// the data blocks stay packed, as VirtualBox's discard keeps them: the data
// of the last data blocks moves into the freed ones (the compaction calls of
// ExtentWriter; ExtentDriver::compact copies, flushes and waits out the I/O
// in flight), blocks_allocated drops by the blocks discarded, and the file is
// cut after the last allocated block once that is durable (a block device,
// or a file with bytes after the blocks, is punched there instead). A
// reverse map (data block -> block, 4 bytes a block) finds the owner of each
// last data block. While a block moves, needs_before_unit_write() is true
// for it (one bit a block, sequentially consistent atomics).
//
// Thread-safety: as ExtentWriter (calls under the driver's allocation lock);
// publish() and the compaction store entries atomically into the VdiMap that
// readers use; needs_before_unit_write() from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "image/extent/writer.h"
#include "image/vdi/header.h"
#include "image/vdi/map.h"
#include "io/buffer.h"

namespace qcowfs::image::vdi {

// Header and block map bytes written back together when the block map starts
// at most this far into the file.
inline constexpr uint64_t kMaxJointMetadataGap = 4ull << 20;

class VdiWriter final : public ExtentWriter {
 public:
  // meta: the file's bytes [meta_base(h), meta_end(h)) (zero-padded past the
  // end of the file); header_bytes: the first kHeaderBytes of the file when
  // meta_base(h) is not 0 (else empty: meta holds the header). Every entry of
  // map below blocks_allocated and no data block named twice (vdi.cc's
  // check_allocation).
  VdiWriter(io::HostFile& file, std::string path, const Header& h, VdiMap& map, io::AlignedBuffer header_bytes,
            io::AlignedBuffer meta);

  // The metadata region kept in memory: the header through the block map when
  // they go out together, else the block map alone.
  static uint64_t meta_base(const Header& h);
  static uint64_t meta_end(const Header& h);

  uint64_t unit_size() const override { return h_.block_size; }
  Task<Result<HostRun>> reserve(uint64_t first, uint64_t n) override;
  void unreserve(const HostRun& run) override;
  void publish(uint64_t first, const HostRun& run) override;
  bool can_unmap() const override { return !h_.is_static(); }
  void unmap(uint64_t first, uint64_t n) override;
  bool compacts() const override { return can_unmap(); }
  std::vector<UnitMove> begin_compaction() override;
  void commit_compaction() override;
  void cancel_compaction() override;
  Task<Status> end_compaction(bool durable) override;
  bool needs_before_unit_write(uint64_t unit) const override;
  bool dirty() const override { return header_dirty_ || !dirty_.empty(); }
  Task<Status> write_metadata() override;
  Task<Status> close_clean() override;

 private:
  // A block unmapped since the last compaction, and the data block it had.
  struct Freed {
    uint64_t block;
    uint32_t index;
  };

  bool joint() const { return meta_base(h_) == 0; }
  uint64_t host_of(uint32_t index) const { return h_.offset_data + uint64_t{index} * h_.block_size; }
  uint64_t data_end() const { return host_of(blocks_allocated_); }
  HostRun place(uint32_t index) { return HostRun{&file_, host_of(index), 1, false}; }
  void set_entry(uint64_t block, uint32_t entry);
  void set_moving(uint64_t block, bool moving);
  Task<Status> cover_allocated_blocks();
  Task<Status> sync_vacated();
  Task<Status> give_back_vacated();
  void patch_header(std::byte* header) const;
  void align_data_area();

  io::HostFile& file_;
  std::string path_;
  Header h_;
  VdiMap& map_;
  io::AlignedBuffer header_;  // used when !joint()
  io::AlignedBuffer meta_;
  uint32_t blocks_allocated_;
  uint32_t disk_allocated_;  // blocks_allocated as last written
  uint64_t zero_from_;       // host bytes from here on read as zeros (never written)
  bool header_dirty_ = false;
  DirtyRange dirty_;  // block map entries changed
  // Compaction (dynamic images only). owner_[index]: the block whose entry
  // names data block index, kUnallocated for none; blocks_allocated_ long.
  std::vector<uint32_t> owner_;
  std::vector<Freed> freed_;                   // unmapped since the last compaction
  std::vector<UnitMove> moves_;                // of the compaction under way
  std::vector<std::atomic<uint64_t>> moving_;  // a bit a block: moves_[i].unit
  uint64_t vacated_end_ = 0;  // host end of data blocks vacated and not yet given back (0: none)
  bool unsynced_ = false;     // a committed compaction not yet known durable
};

}  // namespace qcowfs::image::vdi
