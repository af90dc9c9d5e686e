// Partition tables of a disk image: MBR (primary partitions and the logical
// partitions of an extended partition's EBR chain) and GPT, read through a
// BlockDriver so they work on any format. Partitions are numbered as Linux
// numbers them: MBR primaries 1-4, logicals from 5; GPT entries by their slot
// (1-based). Extended container partitions are not listed (they hold only
// the EBR chain). Every partition is clipped to the disk; entries starting
// beyond it, empty ones and EBR chains that loop or run too long are ignored.
// Thread-safety: free functions; the driver's own rules apply.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "image/block_driver.h"
#include "io/status.h"
#include "io/task.h"

namespace qcowfs::image {

enum class PartitionScheme { none, mbr, gpt };

struct Partition {
  unsigned number = 0;  // Linux numbering: pN
  uint64_t offset = 0;  // bytes from the start of the disk
  uint64_t size = 0;    // bytes
  std::string type;     // MBR: "0x83"; GPT: the type GUID, lowercase
};

// A byte range of the disk.
struct DiskRange {
  uint64_t offset = 0;
  uint64_t length = 0;
};

struct PartitionTable {
  PartitionScheme scheme = PartitionScheme::none;
  std::vector<Partition> partitions;  // by number
  // Every range the table was read from (sector 0, the GPT headers tried and
  // the entry array, each EBR): a write to none of them leaves the table as it is.
  std::vector<DiskRange> read_from;
};

inline constexpr uint64_t kSectorBytes = 512;
inline constexpr unsigned kMaxLogicalPartitions = 128;
inline constexpr uint32_t kMaxGptEntries = 1024;

// Reads the partition table of `disk`. A disk without a valid MBR signature
// has scheme none (not an error); I/O errors are errors.
Task<Result<PartitionTable>> read_partition_table(BlockDriver& disk);

// The pure part, for tests: parses an MBR from its first sector.
struct MbrEntry {
  uint8_t type = 0;
  uint32_t first_lba = 0;
  uint32_t sectors = 0;
};
bool has_mbr_signature(std::span<const std::byte> sector0);
std::vector<MbrEntry> parse_mbr_entries(std::span<const std::byte> sector);
bool is_extended_type(uint8_t type);

// The GUID at p (16 bytes, mixed-endian as GPT stores it) as text.
std::string guid_to_string(const std::byte* p);

}  // namespace qcowfs::image
