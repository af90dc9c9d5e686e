// ParallelsWriter: the ExtentWriter of a Parallels image opened read-write, as
// QEMU 7.2's parallels.c writes one: the header's `inuse` field is set (and
// flushed) at open and cleared on a clean close; a new cluster goes at the end
// of the data (past the last cluster any BAT entry names, or data_off), so the
// clusters of one request are contiguous; BAT entries are kept in memory with
// the header and written back, the changed sectors only, by write_metadata().
// The header holds no allocation count, so a BAT sector is the unit of
// change and needs no ordering with the header.
// Thread-safety: as ExtentWriter (calls under the driver's allocation lock);
// publish() stores entries atomically into the ClusterMap readers use.
#pragma once

#include <cstdint>
#include <string>

#include "image/extent/writer.h"
#include "image/parallels/header.h"
#include "image/parallels/map.h"
#include "io/buffer.h"

namespace qcowfs::image::parallels {

class ParallelsWriter final : public ExtentWriter {
 public:
  // meta: the file's bytes [0, meta_end(h, clusters)) (header and BAT,
  // zero-padded past the end of the file); clusters: the BAT entries that map
  // the disk, all kept in map.
  ParallelsWriter(io::HostFile& file, std::string path, const Header& h, ClusterMap& map, io::AlignedBuffer meta);

  static uint64_t meta_end(uint64_t clusters);

  // Sets `inuse` in the header on disk and flushes (before any change).
  Task<Status> mark_in_use();

  uint64_t unit_size() const override { return h_.cluster_size(); }
  Task<Result<HostRun>> reserve(uint64_t first, uint64_t n) override;
  void unreserve(const HostRun& run) override;
  void publish(uint64_t first, const HostRun& run) override;
  bool dirty() const override { return !dirty_.empty(); }
  Task<Status> write_metadata() override;
  Task<Status> close_clean() override;

 private:
  uint64_t data_end() const;
  Task<Status> write_header(uint32_t inuse);

  io::HostFile& file_;
  std::string path_;
  Header h_;
  ClusterMap& map_;
  io::AlignedBuffer meta_;
  uint64_t unit_;       // bytes a BAT unit
  uint64_t data_end_;   // host byte where the next cluster goes
  uint64_t zero_from_;  // host bytes from here on read as zeros (never written)
  DirtyRange dirty_;    // BAT entries changed
};

}  // namespace qcowfs::image::parallels
