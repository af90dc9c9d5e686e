#include "image/vhdx/log.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "image/endian.h"
#include "image/vhdx/crc32c.h"
#include "io/align.h"
#include "io/buffer.h"

namespace qcowfs::image::vhdx {
namespace {

constexpr uint64_t kWindow = 1 * kMiB;  // log bytes read at once

// Reads the log region a 1 MiB window at a time; bytes past the end of the
// file read as zeros (as QEMU's reads do) without host I/O.
class LogReader {
 public:
  LogReader(io::HostFile& f, uint64_t offset, uint64_t length)
      : file_(f), offset_(offset), length_(length), window_(kWindow, f.mem_align(), true) {}

  uint64_t length() const { return length_; }
  uint64_t next(uint64_t pos) const { return pos + kLogSectorSize >= length_ ? 0 : pos + kLogSectorSize; }

  // The 4096-byte log sector at log position pos (valid until the next call).
  Task<Result<std::span<const std::byte>>> sector(uint64_t pos) {
    const uint64_t start = pos / kWindow * kWindow;
    if (start != start_) QCOWFS_CO_TRY(co_await load(start));
    co_return std::span<const std::byte>(window_.span().subspan(pos - start, kLogSectorSize));
  }

 private:
  Task<Status> load(uint64_t start) {
    start_ = kNone;
    std::memset(window_.data(), 0, kWindow);
    const uint64_t host = offset_ + start;
    const uint64_t size = file_.size();
    if (host < size) {
      const auto n = static_cast<size_t>(std::min<uint64_t>(kWindow, size - host));
      auto got = co_await file_.read(host, window_.span().first(n));
      if (!got) co_return got.status().with_context("reading the VHDX log");
    }
    start_ = start;
    co_return Status::ok();
  }

  static constexpr uint64_t kNone = ~0ull;
  io::HostFile& file_;
  const uint64_t offset_;
  const uint64_t length_;
  io::AlignedBuffer window_;
  uint64_t start_ = kNone;
};

struct EntryHeader {
  uint32_t checksum = 0;
  uint32_t entry_length = 0;
  uint64_t sequence_number = 0;
  uint32_t descriptor_count = 0;
};

// vhdx_log_hdr_is_valid.
bool header_ok(std::span<const std::byte> s, const Header& h, uint64_t log_length, EntryHeader& out) {
  namespace f = log_field;
  if (load_le32(s.data() + f::kSignature) != kLogEntrySignature) return false;
  out.checksum = load_le32(s.data() + f::kChecksum);
  out.entry_length = load_le32(s.data() + f::kEntryLength);
  out.sequence_number = load_le64(s.data() + f::kSequenceNumber);
  out.descriptor_count = load_le32(s.data() + f::kDescriptorCount);
  if (out.entry_length > log_length || out.entry_length % kLogSectorSize != 0) return false;
  if (out.sequence_number == 0) return false;
  if (std::memcmp(s.data() + f::kLogGuid, h.log_guid.data(), h.log_guid.size()) != 0) return false;
  return uint64_t{out.descriptor_count} * f::kDescSize <= out.entry_length;
}

// vhdx_log_desc_is_valid.
bool descriptor_ok(const std::byte* d, uint64_t sequence_number) {
  namespace f = log_field;
  if (load_le64(d + f::kDescSequenceNumber) != sequence_number) return false;
  if (load_le64(d + f::kDescFileOffset) % kLogSectorSize != 0) return false;
  const uint32_t sig = load_le32(d);
  if (sig == kLogZeroSignature) return load_le64(d + f::kDescZeroLength) % kLogSectorSize == 0;
  return sig == kLogDescSignature;
}

class LogSearch {
 public:
  LogSearch(io::HostFile& f, const Header& h, const std::string& path)
      : reader_(f, h.log_offset, h.log_length), header_(h), path_(path) {}

  // vhdx_log_search: the valid sequence whose first entry has the highest
  // sequence number, if any.
  Task<Result<LogSequence>> run() {
    LogSequence best;
    uint64_t read = 0;
    for (;;) {
      const uint64_t tail = read;
      auto first = co_await validate(read, 0);
      if (!first) co_return first.status();
      if (*first != 0) {
        LogSequence current{true, tail, 1, *first, *first};
        // QEMU compares the second entry against sequence 0 (any sequence).
        uint64_t seq = 0;
        for (;;) {
          auto more = co_await validate(read, seq);
          if (!more) co_return more.status();
          if (*more == 0) break;
          seq = *more;
          ++current.count;
          current.last_sequence = *more;
        }
        if (!best.valid || current.first_sequence > best.first_sequence) best = current;
      }
      if (read < tail) co_return best;
    }
  }

 private:
  // vhdx_validate_log_entry at `read`, advancing it as QEMU does: the sequence
  // number of a valid entry, 0 for an invalid one.
  Task<Result<uint64_t>> validate(uint64_t& read, uint64_t prev_seq) {
    if (++steps_ > 4 * (reader_.length() / kLogSectorSize) + 64)
      co_return Status::errorf(EIO, "{}: the VHDX log search does not end", path_);
    auto s = co_await reader_.sector(read);
    if (!s) co_return s.status();
    EntryHeader e;
    if (!header_ok(*s, header_, reader_.length(), e) || (prev_seq > 0 && e.sequence_number != prev_seq + 1)) {
      read = reader_.next(read);
      co_return uint64_t{0};
    }
    const uint64_t desc_sectors = (uint64_t{e.descriptor_count} + 2 + 127) / 128;
    const uint64_t total_sectors = e.entry_length / kLogSectorSize;
    uint32_t crc = 0xFFFFFFFFu;
    for (uint64_t k = 0; k < desc_sectors; ++k) {
      auto sec = co_await reader_.sector(read);
      if (!sec) co_return sec.status();
      QCOWFS_CO_TRY(check_descriptors(*sec, k, e));
      crc = k == 0 ? ~crc32c_with_zeroed_field(*sec, log_field::kChecksum) : crc32c_update(crc, *sec);
      read = reader_.next(read);
    }
    for (uint64_t k = desc_sectors; k < total_sectors; ++k) {
      auto sec = co_await reader_.sector(read);
      if (!sec) co_return sec.status();
      crc = crc32c_update(crc, *sec);
      read = reader_.next(read);
    }
    co_return ~crc == e.checksum ? e.sequence_number : uint64_t{0};
  }

  // The descriptors of sector k of an entry's descriptor area (the entry
  // header takes the first 64 bytes of sector 0).
  Status check_descriptors(std::span<const std::byte> sec, uint64_t k, const EntryHeader& e) const {
    const uint64_t first_byte = k * kLogSectorSize;
    for (uint64_t at = std::max<uint64_t>(first_byte, log_field::kHeaderSize); at < first_byte + kLogSectorSize;
         at += log_field::kDescSize) {
      const uint64_t i = (at - log_field::kHeaderSize) / log_field::kDescSize;
      if (i >= e.descriptor_count) break;
      if (!descriptor_ok(sec.data() + (at - first_byte), e.sequence_number))
        return Status::errorf(EINVAL, "{}: VHDX log entry {} has an invalid descriptor {}", path_, e.sequence_number,
                              i);
    }
    return Status::ok();
  }

  LogReader reader_;
  const Header& header_;
  const std::string& path_;
  uint64_t steps_ = 0;
};

// What a replay may write: nothing in the first MiB (file identifier,
// headers, region tables) or in the log, nothing past the end of the file
// (or the size the entry says the file grows to, within kMaxReplayGrowth).
class ReplayChecker {
 public:
  ReplayChecker(const Header& h, uint64_t file_size, const std::string& path)
      : log_start_(h.log_offset), log_end_(h.log_offset + h.log_length), file_size_(file_size), path_(path) {}

  // The entry's file offsets; the end of what its descriptors may write.
  Result<uint64_t> sizes(uint64_t seq, uint64_t flushed, uint64_t last) const {
    if (flushed > file_size_)
      return Status::errorf(EINVAL,
                            "{}: VHDX log entry {} was written when the file had {} bytes, more than it has now ({}): "
                            "the file was truncated",
                            path_, seq, flushed, file_size_);
    if (last > file_size_ && last - file_size_ > kMaxReplayGrowth)
      return Status::errorf(EINVAL, "{}: VHDX log entry {} grows the file to {} bytes, more than qcowfs replays", path_,
                            seq, last);
    return std::max(file_size_, last);
  }

  Status target(uint64_t seq, uint64_t off, uint64_t len, uint64_t limit) const {
    if (len == 0) return Status::ok();
    if (off < kHeaderSectionSize)
      return Status::errorf(EINVAL, "{}: VHDX log entry {} writes at {:#x}, into the headers or region tables", path_,
                            seq, off);
    if (len > limit || off > limit - len)
      return Status::errorf(EINVAL, "{}: VHDX log entry {} writes {} bytes at {:#x}, past the end of the file", path_,
                            seq, len, off);
    if (off < log_end_ && off + len > log_start_)
      return Status::errorf(EINVAL, "{}: VHDX log entry {} writes at {:#x}, into the log", path_, seq, off);
    return Status::ok();
  }

 private:
  const uint64_t log_start_;
  const uint64_t log_end_;
  const uint64_t file_size_;
  const std::string& path_;
};

// One data sector of entry `seq` with its descriptor d: the 4 KiB it writes.
Result<LogWrite> data_write(const std::byte* d, std::span<const std::byte> sec, uint64_t seq, const std::string& path) {
  namespace f = log_field;
  const uint64_t sector_seq =
      uint64_t{load_le32(sec.data() + f::kDataSequenceHigh)} << 32 | load_le32(sec.data() + f::kDataSequenceLow);
  if (load_le32(sec.data()) != kLogDataSignature || sector_seq != seq)
    return Status::errorf(EINVAL, "{}: VHDX log entry {} has a data sector with signature {:#x}, sequence {}", path,
                          seq, load_le32(sec.data()), sector_seq);
  LogWrite w;
  w.file_offset = load_le64(d + f::kDescFileOffset);
  w.data.resize(kLogSectorSize);
  std::memcpy(w.data.data(), d + f::kDescLeadingBytes, 8);
  std::memcpy(w.data.data() + 8, sec.data() + f::kDataBytes, f::kDataBytesLength);
  std::memcpy(w.data.data() + 8 + f::kDataBytesLength, d + f::kDescTrailingBytes, 4);
  return w;
}

// The entry at log position pos (advanced past it): its writes appended to
// `writes`; the file size it asks for (last_file_offset).
Task<Result<uint64_t>> read_entry(LogReader& reader, uint64_t& pos, const Header& h, const ReplayChecker& check,
                                  const std::string& path, std::vector<LogWrite>& writes) {
  namespace f = log_field;
  auto first = co_await reader.sector(pos);
  if (!first) co_return first.status();
  EntryHeader e;
  if (!header_ok(*first, h, reader.length(), e))
    co_return Status::errorf(EINVAL, "{}: the VHDX log changed while it was read", path);
  const uint64_t last_file_offset = load_le64(first->data() + f::kLastFileOffset);
  auto limit = check.sizes(e.sequence_number, load_le64(first->data() + f::kFlushedFileOffset), last_file_offset);
  if (!limit) co_return limit.status();
  const uint64_t desc_sectors = (uint64_t{e.descriptor_count} + 2 + 127) / 128;
  const uint64_t total = e.entry_length / kLogSectorSize;
  std::vector<std::byte> descs(static_cast<size_t>(desc_sectors * kLogSectorSize));
  uint64_t at = pos;
  for (uint64_t k = 0; k < desc_sectors; ++k) {
    auto sec = co_await reader.sector(at);
    if (!sec) co_return sec.status();
    std::memcpy(descs.data() + k * kLogSectorSize, sec->data(), kLogSectorSize);
    at = reader.next(at);
  }
  uint64_t used = desc_sectors;
  for (uint64_t i = 0; i < e.descriptor_count; ++i) {
    const std::byte* d = descs.data() + f::kHeaderSize + i * f::kDescSize;
    const uint64_t off = load_le64(d + f::kDescFileOffset);
    if (load_le32(d) == kLogZeroSignature) {
      const uint64_t len = load_le64(d + f::kDescZeroLength);
      QCOWFS_CO_TRY(check.target(e.sequence_number, off, len, *limit));
      if (len != 0) writes.push_back(LogWrite{off, len, {}});
      continue;
    }
    if (used >= total)
      co_return Status::errorf(EINVAL, "{}: VHDX log entry {} has more data descriptors than data sectors", path,
                               e.sequence_number);
    auto sec = co_await reader.sector(at);
    if (!sec) co_return sec.status();
    at = reader.next(at);
    ++used;
    auto w = data_write(d, *sec, e.sequence_number, path);
    if (!w) co_return w.status();
    QCOWFS_CO_TRY(check.target(e.sequence_number, off, kLogSectorSize, *limit));
    writes.push_back(std::move(*w));
  }
  for (uint64_t k = 0; k < total; ++k) pos = reader.next(pos);
  co_return align_up(last_file_offset, kLogAlign);
}

}  // namespace

Status check_log_fields(const Header& h, const std::string& path) {
  if (h.log_offset < kLogAlign || h.log_offset % kLogAlign != 0)
    return Status::errorf(EINVAL, "{}: VHDX log offset {:#x} is not a non-zero multiple of 1 MiB", path, h.log_offset);
  if (h.log_version != 0)
    return Status::errorf(EINVAL, "{}: VHDX log version {} is not supported (only 0)", path, h.log_version);
  if (!h.has_log_guid() || h.log_length == 0) return Status::ok();
  if (h.log_length % kLogAlign != 0)
    return Status::errorf(EINVAL, "{}: VHDX log length {} is not a multiple of 1 MiB", path, h.log_length);
  if (h.log_offset > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) - h.log_length)
    return Status::errorf(EINVAL, "{}: VHDX log offset {:#x} is out of range", path, h.log_offset);
  if (h.log_length > kMaxLogLength)
    return Status::errorf(EINVAL, "{}: VHDX log length {} is larger than qcowfs reads (1 GiB)", path, h.log_length);
  return Status::ok();
}

Task<Result<LogSequence>> find_log_sequence(io::HostFile& file, const Header& h, const std::string& path) {
  QCOWFS_CO_TRY(check_log_fields(h, path));
  if (!h.has_log_guid() || h.log_length == 0) co_return LogSequence{};
  co_return co_await LogSearch(file, h, path).run();
}

Task<Status> check_log(io::HostFile& file, const Header& h, const std::string& path) {
  auto found = co_await find_log_sequence(file, h, path);
  if (!found) co_return found.status();
  if (!found->valid) co_return Status::ok();
  co_return Status::errorf(EPERM,
                           "VHDX image file '{0}' opened read-only, but contains a log that needs to be replayed. "
                           "To replay the log, run: qemu-img check -r all '{0}' (or mount it read-write)",
                           path);
}

Task<Result<LogReplay>> read_log_writes(io::HostFile& file, const Header& h, const LogSequence& seq,
                                        const std::string& path) {
  LogReplay out;
  out.next_sequence = seq.last_sequence + 1;
  if (!seq.valid) co_return out;
  LogReader reader(file, h.log_offset, h.log_length);
  ReplayChecker check(h, file.size(), path);
  uint64_t pos = seq.read;
  for (uint64_t k = 0; k < seq.count; ++k) {
    auto entry = co_await read_entry(reader, pos, h, check, path, out.writes);
    if (!entry) co_return entry.status();
    out.file_size = std::max(out.file_size, *entry);
  }
  if (out.file_size <= file.size()) out.file_size = 0;
  co_return out;
}

}  // namespace qcowfs::image::vhdx
