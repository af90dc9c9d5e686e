// OpenFile: the state of one open of a view for writing (the open's
// fuse_file_info::fh; reads-only opens have none).
//
// An open with O_TRUNC, or one that later truncates itself to 0 with
// ftruncate(fd, 0) (qemu-img's raw create does), asks for an empty file. The
// view is a disk and keeps its size and data (op_open ignores O_TRUNC and
// op_setattr the truncation, as a block device does), but a writer that
// truncated expects every range it seeks over to read as zeros: cp, zstd -d,
// dd conv=sparse and other sparse copiers skip the zero blocks of their source
// with lseek instead of writing them, and qemu-img sizes its new file with
// ftruncate and writes only the source's data (through another open, after
// this one closed). So such a truncating open records the ranges it writes and
// the size it last gave its file (ftruncate through it; a smaller size than
// the disk's changes nothing on the disk), and when it is flushed (close,
// fsync) the ranges it skipped between the start of the disk and its end (the
// end of its furthest write or that size, whichever is further) are zeroed.
// Nothing past its end changes. Opens that never truncated (dd conv=notrunc,
// dd seek=N, fio, VMMs, truncate -s) record nothing.
//
// Thread-safety: every method may be called concurrently (writes of one open
// are dispatched on any event-loop thread); a mutex guards the ranges.
// note_written() of an open that records nothing (never truncated, or
// overflowed) returns after one atomic load, without the mutex.
#pragma once

#include <atomic>
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

  // truncating: opened with O_TRUNC.
  explicit OpenFile(bool truncating) : truncating_(truncating), recording_(truncating) {}
  OpenFile(const OpenFile&) = delete;
  OpenFile& operator=(const OpenFile&) = delete;

  // Opened with O_TRUNC or truncated to 0 since.
  bool truncating() const;

  // ftruncate(fd, 0) through this open: from now on it truncates, as if
  // opened with O_TRUNC now (what it wrote before counts no more).
  void truncate_to_zero();
  // ftruncate(fd, size) through a truncating open, once the disk holds at
  // least size bytes: the writer's file now ends at size. No-op for an open
  // that does not truncate.
  void set_size(uint64_t size);
  // [off, off+len) was written (or zeroed) through this open.
  void note_written(uint64_t off, uint64_t len);
  // The ranges in [0, end) that nothing written covers, in order, where end
  // is the end of the furthest write or the size last set, whichever is
  // further; from now on they count as written. Empty when the open does not
  // truncate or stopped tracking.
  std::vector<Range> take_gaps();
  bool overflowed() const;

 private:
  mutable std::mutex mu_;                 // guards the members below
  bool truncating_;
  std::map<uint64_t, uint64_t> written_;  // start -> end, disjoint, not touching
  uint64_t size_ = 0;                     // the size last set since truncating
  bool overflowed_ = false;
  // truncating_ && !overflowed_: whether note_written() records. Written
  // under mu_ with them, read by note_written() without it.
  std::atomic<bool> recording_;
};

}  // namespace qcowfs::fuse
