#include "image/views/partition.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "io/buffer.h"

namespace qcowfs::image {
namespace {

constexpr size_t kMbrEntriesAt = 446;
constexpr size_t kMbrEntrySize = 16;
constexpr size_t kMbrSignatureAt = 510;
constexpr uint8_t kGptProtectiveType = 0xee;
constexpr char kGptSignature[8] = {'E', 'F', 'I', ' ', 'P', 'A', 'R', 'T'};
constexpr size_t kGptHeaderMinSize = 92;
constexpr size_t kGptEntryMinSize = 128;
constexpr uint64_t kMaxGptSectorSize = 4096;

uint32_t le32(const std::byte* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | std::to_integer<uint32_t>(p[i]);
  return v;
}
uint64_t le64(const std::byte* p) { return uint64_t{le32(p)} | (uint64_t{le32(p + 4)} << 32); }

// Reads [off, off+len) (zeros past the end of the disk) and records the range in t.read_from.
Task<Result<io::AlignedBuffer>> read_disk(BlockDriver& disk, uint64_t off, size_t len, PartitionTable& t) {
  t.read_from.push_back(DiskRange{off, len});
  io::AlignedBuffer buf(len, disk.mem_align());
  if (off >= disk.size()) co_return buf;
  size_t n = static_cast<size_t>(std::min<uint64_t>(len, disk.size() - off));
  QCOWFS_CO_TRY(co_await disk.read(off, buf.span().first(n)));
  co_return buf;
}

// Adds a partition clipped to the disk; ignores it when empty or outside.
void add_partition(PartitionTable& t, const BlockDriver& disk, unsigned number, uint64_t offset, uint64_t size,
                   std::string type) {
  if (size == 0 || offset >= disk.size()) return;
  size = std::min(size, disk.size() - offset);
  t.partitions.push_back(Partition{number, offset, size, std::move(type)});
}

std::string mbr_type_name(uint8_t type) { return fmt::format("{:#04x}", type); }

// Walks the EBR chain of the extended partition starting at LBA `ext_start`.
Task<Status> read_logicals(BlockDriver& disk, uint64_t ext_start, uint64_t ext_sectors, PartitionTable& t) {
  std::set<uint64_t> seen;
  uint64_t ebr = ext_start;
  for (unsigned number = 5; number < 5 + kMaxLogicalPartitions; ++number) {
    if (!seen.insert(ebr).second) co_return Status::ok();  // a loop: stop
    auto sector = co_await read_disk(disk, ebr * kSectorBytes, kSectorBytes, t);
    if (!sector) co_return sector.status();
    if (!has_mbr_signature(sector->span())) co_return Status::ok();
    auto entries = parse_mbr_entries(sector->span());
    const MbrEntry& logical = entries[0];
    if (logical.type != 0)
      add_partition(t, disk, number, (ebr + logical.first_lba) * kSectorBytes, uint64_t{logical.sectors} * kSectorBytes,
                    mbr_type_name(logical.type));
    const MbrEntry& next = entries[1];
    if (next.type == 0 || !is_extended_type(next.type) || next.first_lba == 0 || next.first_lba >= ext_sectors)
      co_return Status::ok();
    ebr = ext_start + next.first_lba;
  }
  co_return Status::ok();
}

Task<Status> read_mbr(BlockDriver& disk, std::span<const std::byte> sector0, PartitionTable& t) {
  t.scheme = PartitionScheme::mbr;
  auto entries = parse_mbr_entries(sector0);
  for (unsigned i = 0; i < entries.size(); ++i) {
    const MbrEntry& e = entries[i];
    if (e.type == 0) continue;
    if (is_extended_type(e.type)) {
      QCOWFS_CO_TRY(co_await read_logicals(disk, e.first_lba, e.sectors, t));
      continue;
    }
    add_partition(t, disk, i + 1, uint64_t{e.first_lba} * kSectorBytes, uint64_t{e.sectors} * kSectorBytes,
                  mbr_type_name(e.type));
  }
  std::sort(t.partitions.begin(), t.partitions.end(),
            [](const Partition& a, const Partition& b) { return a.number < b.number; });
  co_return Status::ok();
}

// Reads the GPT header at LBA 1 for a sector size; false if none there.
Task<Result<bool>> read_gpt(BlockDriver& disk, uint64_t sector, PartitionTable& t) {
  auto hdr = co_await read_disk(disk, sector, static_cast<size_t>(sector), t);
  if (!hdr) co_return hdr.status();
  const std::byte* h = hdr->data();
  if (std::memcmp(h, kGptSignature, sizeof kGptSignature) != 0) co_return false;
  uint32_t header_size = le32(h + 12);
  uint64_t entries_lba = le64(h + 72);
  uint32_t count = le32(h + 80), entry_size = le32(h + 84);
  if (header_size < kGptHeaderMinSize || entry_size < kGptEntryMinSize || entry_size % 8 != 0 || entry_size > 4096)
    co_return false;
  count = std::min(count, kMaxGptEntries);
  auto table = co_await read_disk(disk, entries_lba * sector, size_t{count} * entry_size, t);
  if (!table) co_return table.status();
  t.scheme = PartitionScheme::gpt;
  static constexpr std::byte kNoType[16] = {};
  for (uint32_t i = 0; i < count; ++i) {
    const std::byte* e = table->data() + size_t{i} * entry_size;
    if (std::memcmp(e, kNoType, sizeof kNoType) == 0) continue;
    uint64_t first = le64(e + 32), last = le64(e + 40);
    if (last < first) continue;
    add_partition(t, disk, i + 1, first * sector, (last - first + 1) * sector, guid_to_string(e));
  }
  co_return true;
}

}  // namespace

bool has_mbr_signature(std::span<const std::byte> s) {
  return s.size() >= kSectorBytes && s[kMbrSignatureAt] == std::byte{0x55} && s[kMbrSignatureAt + 1] == std::byte{0xaa};
}

std::vector<MbrEntry> parse_mbr_entries(std::span<const std::byte> s) {
  std::vector<MbrEntry> out(4);
  for (size_t i = 0; i < 4; ++i) {
    const std::byte* e = s.data() + kMbrEntriesAt + i * kMbrEntrySize;
    out[i].type = std::to_integer<uint8_t>(e[4]);
    out[i].first_lba = le32(e + 8);
    out[i].sectors = le32(e + 12);
  }
  return out;
}

bool is_extended_type(uint8_t type) { return type == 0x05 || type == 0x0f || type == 0x85; }

std::string guid_to_string(const std::byte* p) {
  auto b = [&](int i) { return std::to_integer<unsigned>(p[i]); };
  return fmt::format("{:02x}{:02x}{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}{:02x}{:02x}{:02x}{:02x}",
                     b(3), b(2), b(1), b(0), b(5), b(4), b(7), b(6), b(8), b(9), b(10), b(11), b(12), b(13), b(14),
                     b(15));
}

Task<Result<PartitionTable>> read_partition_table(BlockDriver& disk) {
  PartitionTable t;
  auto sector0 = co_await read_disk(disk, 0, kSectorBytes, t);
  if (!sector0) co_return sector0.status();
  if (!has_mbr_signature(sector0->span())) co_return t;
  auto entries = parse_mbr_entries(sector0->span());
  bool protective = std::any_of(entries.begin(), entries.end(), [](const MbrEntry& e) { return e.type == kGptProtectiveType; });
  if (protective) {
    for (uint64_t sector = kSectorBytes; sector <= kMaxGptSectorSize; sector *= 2) {
      auto found = co_await read_gpt(disk, sector, t);
      if (!found) co_return found.status();
      if (*found) co_return t;
    }
  }
  QCOWFS_CO_TRY(co_await read_mbr(disk, sector0->span(), t));
  co_return t;
}

}  // namespace qcowfs::image
