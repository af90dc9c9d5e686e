// VpcWriter: the ExtentWriter of a dynamic VHD opened read-write, as QEMU
// 7.2's vpc_co_pwritev() / alloc_block() / rewrite_footer() write one: a new
// block goes where the footer at the end of the file is (QEMU's
// free_data_block_offset), rounded up to format.h's new_block_align() (64 KiB
// for 2 MiB blocks), as padding, its sector bitmap (all ones) and block_size
// bytes of data, the data so aligned (QEMU puts the bitmap right at the old
// footer's place, so its data is 4 KiB-aligned for one block in eight). Only
// the padding's last host-aligned part is written (HostRun::prefix_hole): the
// rest stays a hole, but for an old end footer in it, written over. The footer
// moves to the new end of the file and the BAT entry (a big-endian sector
// number) names the block. The footer copy at offset 0, which QEMU and qcowfs
// read first, never changes. Several new blocks of one request are contiguous
// and written by the driver in one host write, each with its padding and
// bitmap (unit_prefix()).
//
// Ordering (DESIGN.md): the driver flushes data and bitmaps, then
// write_metadata() writes the footer at the new end of the file and flushes
// (so the file covers every block before a BAT entry names it: QEMU refuses a
// BAT block past the end of the file), then the changed BAT sectors; the
// driver flushes again. VHD has no dirty flag.
// Existing blocks: before the first in-place write or zeroing of an open into
// a block whose sector bitmap is not known to be all ones, the bitmap is read
// and, if any bit is clear, rewritten all ones and flushed
// (before_unit_write), as QEMU's get_image_offset(..., write=true) rewrites it
// before writing into a block; otherwise readers that honour the bitmap
// (Hyper-V, Virtual PC, VirtualBox) would not see the write. One bit per block
// says the bitmap is known all ones (blocks this open allocated or checked),
// so later writes pay one atomic load.
// Thread-safety: as ExtentWriter (calls under the driver's allocation lock);
// publish() stores entries atomically into the DynamicMap that readers use;
// needs_before_unit_write() is an atomic load, from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "image/extent/writer.h"
#include "image/vpc/dynamic.h"
#include "image/vpc/header.h"
#include "io/buffer.h"

namespace qcowfs::image::vpc {

// Where a writable open finds things in the file.
struct Layout {
  uint64_t file_size = 0;
  uint64_t header_offset = 0;  // the footer's data_offset: the dynamic-disk header
  DynHeader dyn;
  uint64_t free_offset = 0;  // QEMU's free_data_block_offset: past the BAT and every block
};

// QEMU's free_data_block_offset of a BAT (sector-rounded end of the BAT, past
// every allocated block).
uint64_t free_data_block_offset(const DynHeader& h, const DynamicMap& map);

// Whether new blocks can go at free_offset without spoiling anything in use:
// EIO ("mount it read-only") when a block overlaps the footer copy at 0, the
// dynamic-disk header, the BAT's sectors or another block, when the BAT
// overlaps the footer copy or the header, when the header lies at or past
// free_offset (a new block would overwrite it), or when the data reaches into
// the last 512 bytes of the file (the end footer). Memory: 4 bytes per
// allocated block.
Status check_layout(const Layout& l, const DynamicMap& map, const std::string& path);

class VpcWriter final : public ExtentWriter {
 public:
  // footer: the 512 bytes at offset 0; bat: the file's bytes
  // [bat_base(h), bat_end(h)) (zero-padded past the end of the file).
  VpcWriter(io::HostFile& file, std::string path, const Layout& l, DynamicMap& map, io::AlignedBuffer footer,
            io::AlignedBuffer bat);

  // The BAT's sectors, kept in memory and written back in part.
  static uint64_t bat_base(const DynHeader& h);
  static uint64_t bat_end(const DynHeader& h);

  uint64_t unit_size() const override { return l_.dyn.block_size; }
  // The zero padding and the bitmap (format.h's new_block_pad).
  std::span<const std::byte> unit_prefix() const override { return prefix_.span(); }
  Task<Result<HostRun>> reserve(uint64_t first, uint64_t n) override;
  void unreserve(const HostRun& run) override;
  void publish(uint64_t first, const HostRun& run) override;
  bool dirty() const override { return footer_at_ != free_offset_ || !dirty_.empty(); }
  Task<Status> write_metadata() override;
  bool needs_before_unit_write(uint64_t block) const override;
  Task<Status> before_unit_write(uint64_t block) override;

 private:
  uint64_t padding_hole(uint64_t host) const;
  void set_bitmap_full(uint64_t block);
  bool all_ones(std::span<const std::byte> bitmap) const;

  io::HostFile& file_;
  std::string path_;
  Layout l_;
  DynamicMap& map_;
  io::AlignedBuffer footer_;
  io::AlignedBuffer bat_;
  io::AlignedBuffer bitmap_;  // a new block's sector bitmap: all ones
  uint64_t align_;            // where new blocks' data starts (format.h's new_block_align)
  uint64_t pad_;              // zeros before a new block's bitmap
  io::AlignedBuffer prefix_;  // pad_ zeros, then the bitmap
  uint64_t free_offset_;      // where the next new block goes
  uint64_t footer_at_;        // where write_metadata() last put the footer (or free_offset at open)
  uint64_t zero_from_;        // host bytes from here on read as zeros (never written)
  DirtyRange dirty_;          // BAT entries changed
  // One bit per BAT entry: the block's sector bitmap is known to be all ones
  // (set with release once it is durable; read with acquire).
  std::unique_ptr<std::atomic<uint64_t>[]> bitmap_full_;
};

}  // namespace qcowfs::image::vpc
