// VdiWriter: the ExtentWriter of a VDI image opened read-write, as QEMU 7.2's
// vdi_co_pwritev() allocates: a new block is data block blocks_allocated (the
// next after the last, at offset_data + index * block_size), the block map
// entry names it and the header's blocks_allocated counts it. The header and
// the block map (sector-rounded) are kept in memory; write_metadata() writes
// back what changed. When the block map follows the header closely (every
// image qemu-img and VirtualBox make) the header and the changed part of the
// block map go out in one host write, so that a crash never leaves a block map
// and a blocks_allocated that disagree (qemu-img check's "allocated blocks
// mismatch"); otherwise the header is written first, then the block map
// sectors, as QEMU does. VDI has no dirty flag.
// Thread-safety: as ExtentWriter (calls under the driver's allocation lock);
// publish() stores entries atomically into the VdiMap that readers use.
#pragma once

#include <cstdint>
#include <string>

#include "image/extent_writer.h"
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
  // meta_base(h) is not 0 (else empty: meta holds the header).
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
  bool dirty() const override { return header_dirty_ || !dirty_.empty(); }
  Task<Status> write_metadata() override;

 private:
  bool joint() const { return meta_base(h_) == 0; }
  Task<Status> cover_allocated_blocks();
  void patch_header(std::byte* header) const;

  io::HostFile& file_;
  std::string path_;
  Header h_;
  VdiMap& map_;
  io::AlignedBuffer header_;  // used when !joint()
  io::AlignedBuffer meta_;
  uint32_t blocks_allocated_;
  uint64_t zero_from_;  // host bytes from here on read as zeros (never written)
  bool header_dirty_ = false;
  DirtyRange dirty_;  // block map entries changed
};

}  // namespace qcowfs::image::vdi
