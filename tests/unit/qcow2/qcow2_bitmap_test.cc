// Persistent bitmaps: the in-memory bitmap (granules, ranges, QEMU's on-disk
// cluster layout, resize) and the directory / table parsers, with one test per
// refusal (named after the scenario).
#include <gtest/gtest.h>

#include <cstring>

#include "image/endian.h"
#include "image/qcow2/bitmap_dir.h"
#include "image/qcow2/dirty_bitmap.h"

namespace qcowfs::image::qcow2 {
namespace {

constexpr uint64_t kKiB = 1024, kMiB = 1024 * 1024;
constexpr uint32_t kClusterBits = 16;
constexpr uint64_t kDisk = 16 * kMiB;
constexpr uint64_t kFile = 64 * kMiB;

BitmapDirEntry entry(std::string name, uint8_t gran_bits = 16, uint32_t flags = kBitmapFlagAuto) {
  BitmapDirEntry e;
  e.name = std::move(name);
  e.granularity_bits = gran_bits;
  e.flags = flags;
  e.table_offset = 4 * (uint64_t{1} << kClusterBits);
  e.table_size = static_cast<uint32_t>(bitmap_table_entries(kDisk, gran_bits, kClusterBits));
  return e;
}

void expect_refused(const Result<std::vector<BitmapDirEntry>>& r, std::string_view needle) {
  ASSERT_FALSE(r.is_ok()) << "expected a refusal mentioning '" << needle << "'";
  EXPECT_EQ(r.status().code(), EINVAL);
  EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().message();
}

TEST(DirtyBitmap, SetMarksWholeGranules) {
  DirtyBitmap b(kDisk, 16);
  b.set(64 * kKiB + 1, 1);
  b.set(1 * kMiB - 1, 2);  // straddles two granules
  EXPECT_EQ(b.dirty_ranges(), (std::vector<DirtyRange>{{64 * kKiB, 64 * kKiB}, {kMiB - 64 * kKiB, 128 * kKiB}}));
}

TEST(DirtyBitmap, LastGranuleIsClippedAtTheDiskEnd) {
  DirtyBitmap b(kDisk + 4 * kKiB, 16);
  b.set(kDisk, 100 * kKiB);  // runs past the end: clipped
  EXPECT_EQ(b.dirty_ranges(), (std::vector<DirtyRange>{{kDisk, 4 * kKiB}}));
}

TEST(DirtyBitmap, SerializesInQemuLayout) {
  DirtyBitmap b(kDisk, 16);
  b.set(0, 1);                // bit 0
  b.set(9 * 64 * kKiB, 1);    // bit 9: byte 1, bit 1
  std::vector<std::byte> c(1 << kClusterBits);
  ASSERT_TRUE(b.serialize_cluster(0, c));
  EXPECT_EQ(c[0], std::byte{0x01});
  EXPECT_EQ(c[1], std::byte{0x02});
  DirtyBitmap back(kDisk, 16);
  back.deserialize_cluster(0, c);
  EXPECT_EQ(back.dirty_ranges(), b.dirty_ranges());
  DirtyBitmap clean(kDisk, 16);
  EXPECT_FALSE(clean.serialize_cluster(0, c)) << "an all-zero cluster is stored as a 0 entry";
}

TEST(DirtyBitmap, BitsPastTheDiskAreIgnoredOnLoad) {
  DirtyBitmap b(100 * kKiB, 16);  // two bits
  std::vector<std::byte> c(1 << kClusterBits, std::byte{0xff});
  b.deserialize_cluster(0, c);
  EXPECT_EQ(b.dirty_ranges(), (std::vector<DirtyRange>{{0, 100 * kKiB}}));
  std::vector<std::byte> out(1 << kClusterBits);
  ASSERT_TRUE(b.serialize_cluster(0, out));
  EXPECT_EQ(out[0], std::byte{0x03});
  EXPECT_EQ(out[1], std::byte{0x00});
}

TEST(DirtyBitmap, GrowStartsCleanShrinkDropsBits) {
  DirtyBitmap b(kDisk, 16);
  b.set(kDisk - 64 * kKiB, 64 * kKiB);
  b.resize(2 * kDisk);
  EXPECT_EQ(b.dirty_ranges(), (std::vector<DirtyRange>{{kDisk - 64 * kKiB, 64 * kKiB}}));
  b.resize(kDisk / 2);
  EXPECT_TRUE(b.empty());
}

// run_at() walks the runs a bitmap view serves as data and holes: they must
// tile the disk exactly as dirty_ranges() says, across word boundaries (64
// granules), with the query's length and the disk's end cutting runs.
TEST(DirtyBitmap, RunsTileTheDiskAsTheDirtyRanges) {
  const uint64_t disk = 200 * 64 * kKiB + 4 * kKiB;  // 201 granules, the last one short
  DirtyBitmap b(disk, 16);
  b.set(0, 1);                             // granule 0
  b.set(63 * 64 * kKiB, 3 * 64 * kKiB);    // 63..65, across a word boundary
  b.set(128 * 64 * kKiB, 64 * 64 * kKiB);  // 128..191: a whole word
  b.set(disk - 1, 1);                      // the short last granule
  std::vector<DirtyRange> from_runs;
  for (uint64_t off = 0; off < disk;) {
    DirtyRun r = b.run_at(off, disk - off);
    ASSERT_GT(r.length, 0u) << off;
    if (r.dirty) {
      if (!from_runs.empty() && from_runs.back().offset + from_runs.back().length == off)
        from_runs.back().length += r.length;  // (runs of one state never touch)
      else
        from_runs.push_back(DirtyRange{off, r.length});
    }
    off += r.length;
  }
  EXPECT_EQ(from_runs, b.dirty_ranges());
  EXPECT_EQ(b.dirty_bytes(), 68 * 64 * kKiB + 4 * kKiB);
  // Mid-granule starts and short queries.
  EXPECT_EQ(b.run_at(64 * kKiB + 5, disk).length, 63 * 64 * kKiB - (64 * kKiB + 5));
  EXPECT_FALSE(b.run_at(64 * kKiB + 5, disk).dirty);
  EXPECT_EQ(b.run_at(130 * 64 * kKiB + 7, 10).length, 10u);
  EXPECT_TRUE(b.run_at(130 * 64 * kKiB + 7, 10).dirty);
  EXPECT_EQ(b.run_at(disk - 4 * kKiB, 1 * kMiB).length, 4 * kKiB);
  EXPECT_EQ(b.run_at(disk, 1).length, 0u);
}

TEST(BitmapDir, RoundTrips) {
  std::vector<BitmapDirEntry> in{entry("b0"), entry("longer-name", 20, kBitmapFlagInUse)};
  in[1].table_offset = 5 * (uint64_t{1} << kClusterBits);
  auto bytes = serialize_bitmap_dir(in);
  EXPECT_EQ(bytes.size(), 32u + 40u);
  auto out = parse_bitmap_dir(bytes, 2, kClusterBits, kDisk, kFile);
  ASSERT_TRUE(out.is_ok()) << out.status().to_string();
  ASSERT_EQ(out->size(), 2u);
  EXPECT_EQ((*out)[1].name, "longer-name");
  EXPECT_EQ((*out)[1].granularity_bits, 20);
  EXPECT_TRUE((*out)[1].in_use());
}

TEST(BitmapDir, CountBelowEntriesIsRefused) {
  auto bytes = serialize_bitmap_dir({entry("a"), entry("b")});
  expect_refused(parse_bitmap_dir(bytes, 1, kClusterBits, kDisk, kFile), "More bitmaps");
  expect_refused(parse_bitmap_dir(bytes, 3, kClusterBits, kDisk, kFile), "Less bitmaps");
}

TEST(BitmapDir, NamePastTheDirectoryIsBroken) {
  auto bytes = serialize_bitmap_dir({entry("b0")});
  store_be16(bytes.data() + offsetof(BitmapDirEntryLayout, name_size), 0xffff);
  expect_refused(parse_bitmap_dir(bytes, 1, kClusterBits, kDisk, kFile), "Broken bitmap directory");
}

TEST(BitmapDir, ExtraDataIsRefused) {
  auto bytes = serialize_bitmap_dir({entry("b0")});
  bytes.resize(bytes.size() + 8);
  store_be32(bytes.data() + offsetof(BitmapDirEntryLayout, extra_data_size), 8);
  expect_refused(parse_bitmap_dir(bytes, 1, kClusterBits, kDisk, kFile), "extra data");
}

TEST(BitmapDir, ConstraintsFollowQemu) {
  auto refused = [](BitmapDirEntry e) {
    expect_refused(parse_bitmap_dir(serialize_bitmap_dir({e}), 1, kClusterBits, kDisk, kFile), "constraints");
  };
  BitmapDirEntry e = entry("g");
  e.granularity_bits = 8;
  refused(e);
  e = entry("g");
  e.granularity_bits = 32;
  refused(e);
  e = entry("t");
  e.table_offset += 512;  // unaligned
  refused(e);
  e = entry("f");
  e.flags |= 1u << 5;
  refused(e);
  e = entry("s");
  e.table_size = 0;
  refused(e);
  e = entry("small", 9);  // 16 MiB at 512 B needs 4 KiB of bits: one table entry is enough
  e.table_size = 1;
  EXPECT_TRUE(parse_bitmap_dir(serialize_bitmap_dir({e}), 1, kClusterBits, kDisk, kFile).is_ok());
  EXPECT_TRUE(parse_bitmap_dir(serialize_bitmap_dir({e}), 1, kClusterBits, 1ull << 40, kFile).status().code() ==
              EINVAL) << "a table too small for the disk";
}

TEST(BitmapDir, TableOutsideTheFileIsRefused) {
  BitmapDirEntry e = entry("b0");
  e.table_offset = kFile;
  expect_refused(parse_bitmap_dir(serialize_bitmap_dir({e}), 1, kClusterBits, kDisk, kFile), "outside the file");
}

TEST(BitmapDir, DuplicateNamesAreRefused) {
  expect_refused(parse_bitmap_dir(serialize_bitmap_dir({entry("b"), entry("b")}), 2, kClusterBits, kDisk, kFile),
                 "Duplicate");
}

TEST(BitmapTable, EntriesFollowQemuRules) {
  BitmapDirEntry e = entry("b0");
  e.table_size = 1;
  std::vector<std::byte> t(8);
  auto parse = [&](uint64_t v) {
    store_be64(t.data(), v);
    return parse_bitmap_table(t, e, kClusterBits, kFile);
  };
  EXPECT_TRUE(parse(0).is_ok());
  EXPECT_TRUE(parse(kBitmapTableAllOnes).is_ok());
  EXPECT_TRUE(parse(uint64_t{8} << kClusterBits).is_ok());
  EXPECT_FALSE(parse((uint64_t{8} << kClusterBits) | kBitmapTableAllOnes).is_ok()) << "all-ones with an offset";
  EXPECT_FALSE(parse(0x2).is_ok()) << "reserved bit";
  EXPECT_FALSE(parse((uint64_t{8} << kClusterBits) + 512).is_ok()) << "unaligned data cluster";
  EXPECT_FALSE(parse(kFile).is_ok()) << "data cluster past the end of the file";
}

TEST(BitmapRanges, OverlapIsRefused) {
  EXPECT_TRUE(check_bitmap_ranges_disjoint({{0x10000, 0x10000, "a"}, {0x20000, 0x100, "b"}}).is_ok());
  auto st = check_bitmap_ranges_disjoint({{0x20000, 0x100, "b"}, {0x10000, 0x10001, "a"}});
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("overlaps"), std::string::npos) << st.message();
}

TEST(NewBitmap, QemuLimits) {
  EXPECT_TRUE(check_new_bitmap(kDisk, kClusterBits, "b", 64 * kKiB).is_ok());
  EXPECT_NE(check_new_bitmap(kDisk, kClusterBits, "b", 256).message().find("under minimum"), std::string::npos);
  EXPECT_NE(check_new_bitmap(kDisk, kClusterBits, "b", 1ull << 32).message().find("exceeds maximum"),
            std::string::npos);
  EXPECT_NE(check_new_bitmap(kDisk, kClusterBits, std::string(1024, 'n'), 65536).message().find("Name length"),
            std::string::npos);
}

}  // namespace
}  // namespace qcowfs::image::qcow2
