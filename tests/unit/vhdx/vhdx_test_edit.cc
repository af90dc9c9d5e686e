// Test-only VHDX editor (vhdx_test_edit.h).
#include "unit/vhdx/vhdx_test_edit.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <fstream>

#include "image/endian.h"
#include "image/vhdx/crc32c.h"
#include "image/vhdx/log_writer.h"
#include "unit/io/io_test_util.h"

namespace qcowfs::image::vhdx::testing {

namespace {

bool same_guid(const std::byte* p, const Guid& g) { return std::memcmp(p, g.data(), g.size()) == 0; }

}  // namespace

void fix_checksum(std::span<std::byte> block, size_t at) {
  store_le32(block.data() + at, crc32c_with_zeroed_field(block, at));
}

Bytes log_entry(const Guid& log_guid, uint64_t sequence, const std::vector<LogWrite>& writes,
                uint64_t flushed_file_offset, uint64_t last_file_offset, uint32_t tail) {
  namespace f = log_field;
  const uint64_t count = writes.size();
  const uint64_t desc_sectors = (count + 2 + 127) / 128;
  const size_t total = static_cast<size_t>((desc_sectors + count) * kLogSectorSize);
  Bytes entry(total);
  std::byte* e = entry.data();
  store_le32(e + f::kSignature, kLogEntrySignature);
  store_le32(e + f::kEntryLength, static_cast<uint32_t>(total));
  store_le32(e + f::kTail, tail);
  store_le64(e + f::kSequenceNumber, sequence);
  store_le32(e + f::kDescriptorCount, static_cast<uint32_t>(count));
  std::memcpy(e + f::kLogGuid, log_guid.data(), log_guid.size());
  store_le64(e + f::kFlushedFileOffset, flushed_file_offset);
  store_le64(e + f::kLastFileOffset, last_file_offset);
  for (size_t i = 0; i < writes.size(); ++i) {
    const LogWrite& w = writes[i];
    EXPECT_EQ(w.data.size(), kLogSectorSize);
    EXPECT_EQ(w.file_offset % kLogSectorSize, 0u);
    if (w.data.size() != kLogSectorSize) continue;
    std::byte* d = e + f::kHeaderSize + f::kDescSize * i;
    store_le32(d, kLogDescSignature);
    std::memcpy(d + f::kDescTrailingBytes, w.data.data() + kLogSectorSize - 4, 4);
    std::memcpy(d + f::kDescLeadingBytes, w.data.data(), 8);
    store_le64(d + f::kDescFileOffset, w.file_offset);
    store_le64(d + f::kDescSequenceNumber, sequence);
    std::byte* s = e + (desc_sectors + i) * kLogSectorSize;
    store_le32(s, kLogDataSignature);
    store_le32(s + f::kDataSequenceHigh, static_cast<uint32_t>(sequence >> 32));
    std::memcpy(s + f::kDataBytes, w.data.data() + f::kDataBytes, f::kDataBytesLength);
    store_le32(s + f::kDataSequenceLow, static_cast<uint32_t>(sequence));
  }
  fix_checksum(entry, f::kChecksum);
  return entry;
}

Editor Editor::load(const std::string& path) { return Editor(io::testing::read_file(path)); }

void Editor::save(const std::string& path) const {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(image_.data()), static_cast<std::streamsize>(image_.size()));
  EXPECT_TRUE(out.good()) << "writing " << path;
}

Bytes Editor::read(uint64_t off, size_t len) const {
  Bytes out(len);
  if (off < image_.size()) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(len, image_.size() - off));
    std::memcpy(out.data(), image_.data() + off, n);
  }
  return out;
}

void Editor::write(uint64_t off, std::span<const std::byte> data) {
  if (off + data.size() > image_.size()) image_.resize(static_cast<size_t>(off + data.size()));
  std::memcpy(image_.data() + off, data.data(), data.size());
}

uint64_t Editor::le64(uint64_t off) const { return load_le64(read(off, 8).data()); }
uint32_t Editor::le32(uint64_t off) const { return load_le32(read(off, 4).data()); }

uint64_t Editor::sequence_number(int index) const {
  return le64(kHeaderOffsets[index] + header_field::kSequenceNumber);
}

uint64_t Editor::log_offset(int index) const { return le64(kHeaderOffsets[index] + header_field::kLogOffset); }

int Editor::current_header_index() const { return sequence_number(0) > sequence_number(1) ? 0 : 1; }

void Editor::set_log_guid(int index, const Guid& guid) {
  Bytes h = read(kHeaderOffsets[index], kHeaderSize);
  std::memcpy(h.data() + header_field::kLogGuid, guid.data(), guid.size());
  fix_checksum(h, header_field::kChecksum);
  write(kHeaderOffsets[index], h);
}

size_t Editor::region_entry_at(const Guid& region) const {
  const Bytes table = read(kRegionTableOffset, kRegionTableSize);
  const uint32_t count = std::min(load_le32(table.data() + kRegionEntryCountAt), kMaxRegionEntries);
  for (size_t i = 0; i < count; ++i) {
    const size_t at = kRegionHeaderSize + kRegionEntrySize * i;
    if (same_guid(table.data() + at, region)) return at;
  }
  ADD_FAILURE() << "the image has no such region";
  return 0;
}

uint64_t Editor::region_offset(const Guid& region) const {
  return le64(kRegionTableOffset + region_entry_at(region) + 16);
}

void Editor::set_region_length(const Guid& region, uint32_t length) {
  const size_t at = region_entry_at(region);
  Bytes table = read(kRegionTableOffset, kRegionTableSize);
  store_le32(table.data() + at + 24, length);
  fix_checksum(table, 4);
  write(kRegionTableOffset, table);
}

uint64_t Editor::metadata_item_offset(const Guid& item) const {
  const uint64_t base = metadata_offset();
  const Bytes table = read(base, kMetadataTableSize);
  const uint16_t count = std::min<uint16_t>(load_le16(table.data() + kMetadataEntryCountAt), 2047);
  for (size_t i = 0; i < count; ++i) {
    const std::byte* e = table.data() + kMetadataHeaderSize + kMetadataEntrySize * i;
    if (same_guid(e, item)) return base + load_le32(e + 16);
  }
  ADD_FAILURE() << "the image has no such metadata item";
  return 0;
}

uint32_t Editor::metadata_u32(const Guid& item) const { return le32(metadata_item_offset(item)); }

void Editor::set_metadata_u32(const Guid& item, uint32_t value) {
  Bytes v(4);
  store_le32(v.data(), value);
  write(metadata_item_offset(item), v);
}

uint64_t Editor::chunk_ratio() const { return kMaxSectorsPerBlock * kLogicalSectorSize / block_size(); }

uint64_t Editor::bat_index(uint64_t block) const { return block + block / chunk_ratio(); }

uint64_t Editor::bat(uint64_t index) const { return le64(bat_offset() + kBatEntrySize * index); }

void Editor::set_bat(uint64_t index, uint64_t value) {
  Bytes v(8);
  store_le64(v.data(), value);
  write(bat_offset() + kBatEntrySize * index, v);
}

void Editor::set_bat_state(uint64_t index, uint64_t state) { set_bat(index, (bat(index) & ~kBatStateMask) | state); }

Guid Editor::write_pending_log(const std::vector<LogWrite>& writes, uint64_t sequence) {
  const Guid guid = random_guid();
  const int cur = current_header_index();
  const uint64_t size = image_.size();
  write(log_offset(cur), log_entry(guid, sequence, writes, size, size));
  set_log_guid(cur, guid);
  return guid;
}

}  // namespace qcowfs::image::vhdx::testing
