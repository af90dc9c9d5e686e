#include "image/vhdx/log.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "image/endian.h"
#include "image/vhdx/crc32c.h"
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

  // vhdx_log_search: whether a valid sequence of entries exists.
  Task<Result<bool>> run() {
    bool found = false;
    uint64_t read = 0;
    for (;;) {
      const uint64_t tail = read;
      auto first = co_await validate(read, 0);
      if (!first) co_return first.status();
      if (*first != 0) {
        found = true;
        // QEMU compares the second entry against sequence 0 (any sequence).
        uint64_t seq = 0;
        for (;;) {
          auto more = co_await validate(read, seq);
          if (!more) co_return more.status();
          if (*more == 0) break;
          seq = *more;
        }
      }
      if (read < tail) co_return found;
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

}  // namespace

Task<Status> check_log(io::HostFile& file, const Header& h, const std::string& path) {
  if (h.log_offset < kLogAlign || h.log_offset % kLogAlign != 0)
    co_return Status::errorf(EINVAL, "{}: VHDX log offset {:#x} is not a non-zero multiple of 1 MiB", path,
                             h.log_offset);
  if (h.log_version != 0)
    co_return Status::errorf(EINVAL, "{}: VHDX log version {} is not supported (only 0)", path, h.log_version);
  if (!h.has_log_guid() || h.log_length == 0) co_return Status::ok();
  if (h.log_length % kLogAlign != 0)
    co_return Status::errorf(EINVAL, "{}: VHDX log length {} is not a multiple of 1 MiB", path, h.log_length);
  if (h.log_offset > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) - h.log_length)
    co_return Status::errorf(EINVAL, "{}: VHDX log offset {:#x} is out of range", path, h.log_offset);
  if (h.log_length > kMaxLogLength)
    co_return Status::errorf(EINVAL, "{}: VHDX log length {} is larger than qcowfs reads (1 GiB)", path,
                             h.log_length);
  auto found = co_await LogSearch(file, h, path).run();
  if (!found) co_return found.status();
  if (!*found) co_return Status::ok();
  co_return Status::errorf(EPERM,
                           "VHDX image file '{0}' opened read-only, but contains a log that needs to be replayed. "
                           "To replay the log, run: qemu-img check -r all '{0}' (qcowfs opens VHDX images read-only)",
                           path);
}

}  // namespace qcowfs::image::vhdx
