#include "image/vhdx/log_writer.h"

#include <algorithm>
#include <cstring>
#include <random>

#include "image/endian.h"
#include "image/vhdx/crc32c.h"

namespace qcowfs::image::vhdx {
namespace {

constexpr size_t kZeroChunk = 1 * kMiB;  // a zero descriptor's bytes written at once

void store_guid(std::byte* p, const Guid& g) { std::memcpy(p, g.data(), g.size()); }

void store_descriptor(std::byte* d, const SectorWrite& w, uint64_t seq) {
  namespace f = log_field;
  store_le32(d, kLogDescSignature);
  std::memcpy(d + f::kDescTrailingBytes, w.data.data() + kLogSectorSize - 4, 4);
  std::memcpy(d + f::kDescLeadingBytes, w.data.data(), 8);
  store_le64(d + f::kDescFileOffset, w.file_offset);
  store_le64(d + f::kDescSequenceNumber, seq);
}

void store_data_sector(std::byte* s, const SectorWrite& w, uint64_t seq) {
  namespace f = log_field;
  store_le32(s, kLogDataSignature);
  store_le32(s + f::kDataSequenceHigh, static_cast<uint32_t>(seq >> 32));
  std::memcpy(s + f::kDataBytes, w.data.data() + 8, f::kDataBytesLength);
  store_le32(s + f::kDataSequenceLow, static_cast<uint32_t>(seq));
}

Task<Status> write_zeros(io::HostFile& file, uint64_t off, uint64_t len) {
  io::AlignedBuffer zeros(static_cast<size_t>(std::min<uint64_t>(len, kZeroChunk)), file.mem_align(), true);
  for (uint64_t done = 0; done < len;) {
    const uint64_t n = std::min<uint64_t>(len - done, kZeroChunk);
    QCOWFS_CO_TRY(co_await file.write(off + done, zeros.span().first(static_cast<size_t>(n))));
    done += n;
  }
  co_return Status::ok();
}

}  // namespace

Guid random_guid() {
  std::random_device rd;
  Guid g;
  for (size_t i = 0; i < g.size(); i += 4) {
    const uint32_t r = rd();
    std::memcpy(g.data() + i, &r, 4);
  }
  g[7] = static_cast<uint8_t>((g[7] & 0x0f) | 0x40);  // version 4 (data3's high nibble)
  g[8] = static_cast<uint8_t>((g[8] & 0x3f) | 0x80);  // RFC 4122 variant
  return g;
}

HeaderPair::HeaderPair(io::HostFile& file, io::AlignedBuffer h1, io::AlignedBuffer h2, int current, std::string path)
    : file_(file),
      blocks_{std::move(h1), std::move(h2)},
      current_(current),
      path_(std::move(path)),
      session_guid_(random_guid()) {}

uint64_t HeaderPair::sequence() const { return load_le64(blocks_[current_].data() + header_field::kSequenceNumber); }

Guid HeaderPair::log_guid() const { return load_guid(blocks_[current_].data() + header_field::kLogGuid); }

Task<Status> HeaderPair::update(bool new_data_write_guid, const Guid* log_guid) {
  namespace f = header_field;
  const int next = 1 - current_;
  std::byte* b = blocks_[next].data();
  std::memcpy(b, blocks_[current_].data(), kHeaderSize);
  store_le64(b + f::kSequenceNumber, sequence() + 1);
  store_guid(b + f::kFileWriteGuid, session_guid_);
  if (new_data_write_guid) store_guid(b + f::kDataWriteGuid, random_guid());
  if (log_guid != nullptr) store_guid(b + f::kLogGuid, *log_guid);
  store_le32(b + f::kChecksum, crc32c_with_zeroed_field(blocks_[next].span().first(kHeaderSize), f::kChecksum));
  Status st = co_await file_.write(kHeaderOffsets[next], blocks_[next].span().first(kHeaderSize));
  if (st) st = co_await file_.flush();
  if (!st) co_return st.with_context(path_ + ": writing a VHDX header");
  current_ = next;
  co_return Status::ok();
}

Task<Status> HeaderPair::update_both(bool new_data_write_guid, const Guid* log_guid) {
  QCOWFS_CO_TRY(co_await update(new_data_write_guid, log_guid));
  co_return co_await update(new_data_write_guid, log_guid);
}

uint64_t descriptor_sectors(uint64_t descriptors) { return (descriptors + 2 + 127) / 128; }

uint64_t max_entry_sectors(uint64_t log_length) {
  const uint64_t room = log_length / kLogSectorSize;  // sectors; one stays free
  if (room < 3) return 0;
  uint64_t n = room - 2;
  while (n > 0 && descriptor_sectors(n) + n > room - 1) --n;
  return n;
}

io::AlignedBuffer build_log_entry(uint64_t seq, const Guid& log_guid, uint64_t file_size,
                                  std::span<const SectorWrite> sectors, size_t mem_align) {
  namespace f = log_field;
  const uint64_t desc_sectors = descriptor_sectors(sectors.size());
  const uint64_t length = (desc_sectors + sectors.size()) * kLogSectorSize;
  io::AlignedBuffer entry(static_cast<size_t>(length), mem_align, true);
  std::byte* e = entry.data();
  store_le32(e + f::kSignature, kLogEntrySignature);
  store_le32(e + f::kEntryLength, static_cast<uint32_t>(length));
  store_le32(e + f::kTail, 0);  // the entry is the whole active sequence, at the start of the log
  store_le64(e + f::kSequenceNumber, seq);
  store_le32(e + f::kDescriptorCount, static_cast<uint32_t>(sectors.size()));
  store_guid(e + f::kLogGuid, log_guid);
  store_le64(e + f::kFlushedFileOffset, file_size);
  store_le64(e + f::kLastFileOffset, file_size);
  for (size_t i = 0; i < sectors.size(); ++i) {
    store_descriptor(e + f::kHeaderSize + i * f::kDescSize, sectors[i], seq);
    store_data_sector(e + (desc_sectors + i) * kLogSectorSize, sectors[i], seq);
  }
  store_le32(e + f::kChecksum, crc32c_with_zeroed_field(entry.span(), f::kChecksum));
  return entry;
}

Task<Status> log_write_and_flush(io::HostFile& file, HeaderPair& headers, const Header& h, uint64_t seq,
                                 std::span<const SectorWrite> sectors, const std::string& path) {
  const Guid guid = random_guid();
  QCOWFS_CO_TRY(co_await headers.update_both(false, &guid));
  io::AlignedBuffer entry = build_log_entry(seq, guid, file.size(), sectors, file.mem_align());
  Status st = co_await file.write(h.log_offset, entry.span());
  if (st) st = co_await file.flush();
  if (!st) co_return st.with_context(path + ": writing the VHDX log");
  for (const SectorWrite& w : sectors) {
    st = co_await file.write(w.file_offset, w.data);
    if (!st) co_return st.with_context(path + ": writing VHDX metadata after its log entry");
  }
  QCOWFS_CO_TRY(co_await file.flush());
  const Guid zero{};
  co_return co_await headers.update_both(false, &zero);
}

Task<Status> replay(io::HostFile& file, HeaderPair& headers, const LogReplay& r, const std::string& path) {
  QCOWFS_CO_TRY(co_await headers.update_both(true, nullptr));
  io::AlignedBuffer sector(kLogSectorSize, file.mem_align(), false);
  for (const LogWrite& w : r.writes) {
    Status st;
    if (w.data.empty()) {
      st = co_await write_zeros(file, w.file_offset, w.zero_length);
    } else {
      std::memcpy(sector.data(), w.data.data(), kLogSectorSize);
      st = co_await file.write(w.file_offset, sector.span());
    }
    if (!st) co_return st.with_context(path + ": replaying the VHDX log");
  }
  if (r.file_size > file.size() && !file.is_block_device()) QCOWFS_CO_TRY(co_await file.truncate(r.file_size));
  QCOWFS_CO_TRY(co_await file.flush());
  const Guid zero{};
  co_return co_await headers.update_both(false, &zero);
}

}  // namespace qcowfs::image::vhdx
