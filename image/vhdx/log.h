// The VHDX log on open: QEMU (block/vhdx-log.c, vhdx_parse_log) searches the
// log of the current header for a valid sequence of entries and, when it finds
// one, replays it on a read-write open and refuses a read-only open.
// - check_log(): the read-only open's answer: ok when the log is empty (zero
//   log GUID or length) or holds no valid entry; EPERM, with QEMU's advice to
//   replay it, when it does; EINVAL for the fields QEMU refuses (log offset,
//   version, length, an invalid descriptor in an entry with a valid header).
// - find_log_sequence() + read_log_writes(): the read-write open's replay
//   plan: the sectors the valid sequence writes, every entry re-checked and
//   every target checked against the file (image/vhdx/replay.h applies it).
// Thread-safety: one call at a time per file (each reads through its own buffer).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "image/vhdx/header.h"
#include "io/host_file.h"
#include "io/status.h"
#include "io/task.h"

namespace qcowfs::image::vhdx {

// The log fields QEMU checks on every open (offset, version, length).
Status check_log_fields(const Header& header, const std::string& path);

// The sequence vhdx_log_search picks: `count` entries from log position
// `read` (the one whose first entry has the highest sequence number).
struct LogSequence {
  bool valid = false;
  uint64_t read = 0;
  uint64_t count = 0;
  uint64_t first_sequence = 0;
  uint64_t last_sequence = 0;
};
Task<Result<LogSequence>> find_log_sequence(io::HostFile& file, const Header& header, const std::string& path);

Task<Status> check_log(io::HostFile& file, const Header& header, const std::string& path);

// One 4 KiB sector write (data) or a run of zero sectors (zero_length > 0,
// data empty) that a log replay makes.
struct LogWrite {
  uint64_t file_offset = 0;
  uint64_t zero_length = 0;
  std::vector<std::byte> data;
};
struct LogReplay {
  std::vector<LogWrite> writes;
  uint64_t file_size = 0;      // what the file must grow to (last_file_offset, MiB-rounded), else 0
  uint64_t next_sequence = 0;  // the sequence number of the next entry written
};

// The writes of sequence `seq` (valid) in the order QEMU's vhdx_log_flush makes
// them. EINVAL, with nothing to write, for an entry QEMU refuses (flushed file
// offset past the end of the file, a data sector whose sequence number
// disagrees) and for what qcowfs refuses to write: a target in the first MiB
// (file identifier, headers, region tables), in the log, or past the end of
// the file, a missing data sector, and growth of the file by more than
// kMaxReplayGrowth.
Task<Result<LogReplay>> read_log_writes(io::HostFile& file, const Header& header, const LogSequence& seq,
                                        const std::string& path);

}  // namespace qcowfs::image::vhdx
