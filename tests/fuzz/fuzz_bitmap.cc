// libFuzzer target: the persistent bitmap directory and table parsers
// (image/qcow2/bitmap_dir.h) and the in-memory bitmap's on-disk layout
// (dirty_bitmap.h) over arbitrary bytes, checking that what parses satisfies
// QEMU's constraints and survives serialisation unchanged.
// Input (little-endian): u8 cluster_bits, u32 nb_bitmaps, u32 directory
// length, u64 disk size, the directory, then table bytes / bitmap data.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "image/qcow2/bitmap_dir.h"
#include "image/qcow2/dirty_bitmap.h"

namespace q = qcowfs::image::qcow2;

namespace {

void check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz_bitmap invariant broken: %s\n", what);
    std::abort();
  }
}

template <typename T>
bool take(const uint8_t*& p, size_t& left, T* out) {
  if (left < sizeof(T)) return false;
  std::memcpy(out, p, sizeof(T));
  p += sizeof(T);
  left -= sizeof(T);
  return true;
}

constexpr uint64_t kFileSize = 1ull << 30;
constexpr uint64_t kMaxFuzzDisk = 1ull << 32;  // keeps the in-memory bitmaps small

void check_entries(const std::vector<q::BitmapDirEntry>& entries, uint32_t cluster_bits, uint64_t disk,
                   std::span<const std::byte> rest) {
  for (const q::BitmapDirEntry& e : entries) {
    check(e.granularity_bits >= q::kBitmapMinGranularityBits && e.granularity_bits <= q::kBitmapMaxGranularityBits,
          "granularity outside QEMU's bounds");
    check(e.table_size > 0 && e.table_size <= q::kBitmapMaxTableSize, "table size outside QEMU's bounds");
    check((e.flags & q::kBitmapReservedFlags) == 0, "reserved flag accepted");
    const uint64_t bytes = uint64_t{e.table_size} * q::kBitmapTableEntrySize;
    if (bytes <= rest.size()) {
      auto t = q::parse_bitmap_table(rest.first(bytes), e, cluster_bits, kFileSize);
      if (t)
        for (uint64_t v : *t) check((v & q::kBitmapTableReservedMask) == 0, "reserved table bits accepted");
    }
  }
  auto again = q::parse_bitmap_dir(q::serialize_bitmap_dir(entries), static_cast<uint32_t>(entries.size()),
                                   cluster_bits, disk, kFileSize);
  check(again.is_ok() && again->size() == entries.size(), "a parsed directory does not parse again");
}

void fuzz_bits(uint32_t cluster_bits, uint64_t disk, uint8_t gran, std::span<const std::byte> rest) {
  const uint64_t cs = uint64_t{1} << cluster_bits;
  if (rest.size() < cs || disk > kMaxFuzzDisk) return;
  q::DirtyBitmap b(disk, q::kBitmapMinGranularityBits + static_cast<uint32_t>(gran % 8u));
  b.deserialize_cluster(0, rest.first(cs));
  std::vector<std::byte> out(cs);
  (void)b.serialize_cluster(0, out);
  q::DirtyBitmap back(disk, b.granularity_bits());
  back.deserialize_cluster(0, out);
  check(back.dirty_ranges() == b.dirty_ranges(), "serialise/deserialise changed the bits");
  for (const q::DirtyRange& r : b.dirty_ranges()) check(r.length > 0 && r.offset + r.length <= disk, "range past disk");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  uint8_t bits = 0;
  uint32_t nb = 0, dir_len = 0;
  uint64_t disk = 0;
  if (!take(data, size, &bits) || !take(data, size, &nb) || !take(data, size, &dir_len) || !take(data, size, &disk))
    return 0;
  const uint32_t cluster_bits = q::kMinClusterBits + bits % (16 - q::kMinClusterBits + 1);  // up to 64 KiB
  disk %= (1ull << 50);
  std::span<const std::byte> all(reinterpret_cast<const std::byte*>(data), size);
  const size_t n = std::min<size_t>(dir_len, all.size());
  auto entries = q::parse_bitmap_dir(all.first(n), nb, cluster_bits, disk, kFileSize);
  if (entries) check_entries(*entries, cluster_bits, disk, all.subspan(n));
  fuzz_bits(cluster_bits, disk, bits, all.subspan(n));
  return 0;
}
