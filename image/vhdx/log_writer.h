// Writing VHDX metadata as QEMU 7.2 does (block/vhdx.c vhdx_update_header(s),
// block/vhdx-log.c vhdx_log_write_and_flush, vhdx_log_flush):
// - HeaderPair: the two 4 KiB headers. An update writes the inactive one,
//   made from the current one with the sequence number + 1, this open's
//   FileWriteGuid, optionally a new DataWriteGuid and a log GUID, then flushes;
//   it becomes current. QEMU always updates both (update_both()), so that both
//   copies say the same.
// - build_log_entry(): one log entry (header, data descriptors, data sectors,
//   CRC-32C over the whole entry) writing whole 4 KiB sectors.
// - log_write_and_flush(): with the data the entry's sectors point at durable
//   already: a new log GUID in both headers, the entry at the start of the log,
//   flush, the sectors in place, flush, the log GUID zero in both headers (the
//   log is empty again: QEMU writes every entry this way, and refuses to write
//   with a log GUID set).
// - replay(): applies a LogReplay on a read-write open as vhdx_log_flush does.
// Thread-safety: none; the caller serializes (the ExtentDriver's allocation lock, or the open).
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "image/vhdx/format.h"
#include "image/vhdx/header.h"
#include "image/vhdx/log.h"
#include "io/buffer.h"
#include "io/host_file.h"
#include "io/status.h"
#include "io/task.h"

namespace qcowfs::image::vhdx {

// A random (version 4) GUID.
Guid random_guid();

class HeaderPair {
 public:
  // h1, h2: the 4 KiB header blocks at 64 KiB and 128 KiB; current: the index
  // choose_header() picked.
  HeaderPair(io::HostFile& file, io::AlignedBuffer h1, io::AlignedBuffer h2, int current, std::string path);

  int current() const { return current_; }
  std::span<const std::byte> block(int index) const { return blocks_[index].span(); }
  uint64_t sequence() const;
  Guid log_guid() const;

  // vhdx_update_headers: two updates, each written and flushed.
  Task<Status> update_both(bool new_data_write_guid, const Guid* log_guid);

 private:
  Task<Status> update(bool new_data_write_guid, const Guid* log_guid);

  io::HostFile& file_;
  io::AlignedBuffer blocks_[2];
  int current_;
  std::string path_;
  Guid session_guid_;  // this open's FileWriteGuid
};

// One 4 KiB sector that a log entry writes.
struct SectorWrite {
  uint64_t file_offset = 0;
  std::span<const std::byte> data;  // kLogSectorSize bytes
};

// The descriptor sectors an entry with `descriptors` descriptors needs
// (vhdx_compute_desc_sectors: the entry header takes two descriptors' room).
uint64_t descriptor_sectors(uint64_t descriptors);
// The most data sectors one entry holds in a log of log_length bytes (QEMU's
// writer stops one sector short of a full log).
uint64_t max_entry_sectors(uint64_t log_length);

// The entry (entry_length bytes, aligned to mem_align) of sequence `seq`
// writing `sectors`; flushed_file_offset = last_file_offset = file_size.
io::AlignedBuffer build_log_entry(uint64_t seq, const Guid& log_guid, uint64_t file_size,
                                  std::span<const SectorWrite> sectors, size_t mem_align);

// QEMU's vhdx_log_write_and_flush for sectors that fit one entry
// (max_entry_sectors(header.log_length)), minus its first flush (the caller's).
Task<Status> log_write_and_flush(io::HostFile& file, HeaderPair& headers, const Header& header, uint64_t seq,
                                 std::span<const SectorWrite> sectors, const std::string& path);

// vhdx_log_flush: a new DataWriteGuid in both headers, the writes, the file
// grown to r.file_size (if set), flush, then the log GUID zero in both headers.
Task<Status> replay(io::HostFile& file, HeaderPair& headers, const LogReplay& r, const std::string& path);

}  // namespace qcowfs::image::vhdx
