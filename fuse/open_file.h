// OpenFile: the state of one open of a view for writing (the open's
// fuse_file_info::fh; reads-only opens have none).
//
// An open with O_TRUNC asks for an empty file. The view is a disk and keeps
// its size and data (op_open ignores O_TRUNC, as a block device does), but a
// writer that truncated expects every range it seeks over to read as zeros:
// cp, zstd -d, dd conv=sparse and other sparse copiers skip the zero blocks
// of their source with lseek instead of writing them. So such an open records
// the ranges it writes, and when it is flushed (close, fsync) the ranges it
// skipped between the start of the disk and the end of its furthest write are
// zeroed. Nothing past its furthest write changes. Opens without O_TRUNC
// (dd conv=notrunc, dd seek=N, fio, VMMs) record nothing.
//
// Thread-safety: every method may be called concurrently (writes of one open
// are dispatched on any event-loop thread); a mutex guards the ranges.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

namespace qcowfs::fuse {

// Written ranges one truncating open tracks at most; past that it stops
// (an O_TRUNC open writing that scattered is no sparse copy) and zeroes nothing.
constexpr size_t kMaxTrackedRanges = 65536;

class OpenFile {
 public:
  struct Range {
    uint64_t offset = 0;
    uint64_t length = 0;
  };

  explicit OpenFile(bool truncating) : truncating_(truncating) {}
  OpenFile(const OpenFile&) = delete;
  OpenFile& operator=(const OpenFile&) = delete;

  bool truncating() const { return truncating_; }

  // [off, off+len) was written (or zeroed) through this open.
  void note_written(uint64_t off, uint64_t len);
  // The ranges in [0, end of the furthest write) that nothing written
  // covers, in order; from now on they count as written. Empty when the open
  // does not truncate or stopped tracking.
  std::vector<Range> take_gaps();
  bool overflowed() const;

 private:
  const bool truncating_;
  mutable std::mutex mu_;            // guards the members below
  std::map<uint64_t, uint64_t> written_;  // start -> end, disjoint, not touching
  bool overflowed_ = false;
};

}  // namespace qcowfs::fuse
