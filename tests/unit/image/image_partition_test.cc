// Partition table parsing (MBR with an extended partition, GPT) and the
// WindowDriver, on disks held in a MemFile behind a RawDriver.
#include <gtest/gtest.h>

#include <cstring>

#include "image/views/partition.h"
#include "image/raw/raw.h"
#include "image/views/window.h"
#include "io/mem_file.h"
#include "unit/io/io_test_util.h"

namespace qcowfs::image {
namespace {

using io::testing::run_now;
using Bytes = std::vector<std::byte>;

void put_le32(Bytes& b, size_t off, uint32_t v) {
  for (int i = 0; i < 4; ++i) b[off + static_cast<size_t>(i)] = static_cast<std::byte>(v >> (8 * i));
}
void put_le64(Bytes& b, size_t off, uint64_t v) {
  put_le32(b, off, static_cast<uint32_t>(v));
  put_le32(b, off + 4, static_cast<uint32_t>(v >> 32));
}

// Writes MBR-style entry i of the sector at `sector_off`, and the signature.
void mbr_entry(Bytes& disk, uint64_t sector_off, int i, uint8_t type, uint32_t lba, uint32_t sectors) {
  size_t e = static_cast<size_t>(sector_off) + 446 + static_cast<size_t>(i) * 16;
  disk[e + 4] = std::byte{type};
  put_le32(disk, e + 8, lba);
  put_le32(disk, e + 12, sectors);
  disk[sector_off + 510] = std::byte{0x55};
  disk[sector_off + 511] = std::byte{0xaa};
}

struct Disk {
  explicit Disk(Bytes content) : file(io::MemFileOptions{}, std::move(content)), driver(&file, false) {}
  io::MemFile file;
  RawDriver driver;
};

constexpr uint64_t kDiskBytes = 8 << 20;  // 16384 sectors

TEST(Partitions, NoSignatureMeansNoTable) {
  Disk d{Bytes(kDiskBytes)};
  auto t = run_now(read_partition_table(d.driver));
  ASSERT_TRUE(t.is_ok());
  EXPECT_EQ(t->scheme, PartitionScheme::none);
  EXPECT_TRUE(t->partitions.empty());
}

TEST(Partitions, MbrPrimariesAndLogicalsAreNumberedLikeLinux) {
  Bytes disk(kDiskBytes);
  mbr_entry(disk, 0, 0, 0x83, 2048, 2048);
  mbr_entry(disk, 0, 1, 0x05, 4096, 8192);  // extended: sectors 4096..12287
  mbr_entry(disk, 0, 2, 0x0c, 12288, 4096);
  // EBR 1 at 4096: logical at +2048, next EBR at ext+4096.
  mbr_entry(disk, 4096 * 512, 0, 0x83, 2048, 1024);
  mbr_entry(disk, 4096 * 512, 1, 0x05, 4096, 4096);
  // EBR 2 at 8192: logical at +1024, end of chain.
  mbr_entry(disk, 8192 * 512, 0, 0x07, 1024, 2048);
  Disk d(std::move(disk));
  auto t = run_now(read_partition_table(d.driver));
  ASSERT_TRUE(t.is_ok());
  EXPECT_EQ(t->scheme, PartitionScheme::mbr);
  ASSERT_EQ(t->partitions.size(), 4u);
  EXPECT_EQ(t->partitions[0].number, 1u);
  EXPECT_EQ(t->partitions[0].offset, 2048u * 512);
  EXPECT_EQ(t->partitions[1].number, 3u);
  EXPECT_EQ(t->partitions[1].type, "0x0c");
  EXPECT_EQ(t->partitions[2].number, 5u);
  EXPECT_EQ(t->partitions[2].offset, (4096u + 2048) * 512);
  EXPECT_EQ(t->partitions[2].size, 1024u * 512);
  EXPECT_EQ(t->partitions[3].number, 6u);
  EXPECT_EQ(t->partitions[3].offset, (8192u + 1024) * 512);
  EXPECT_EQ(t->partitions[3].type, "0x07");
}

TEST(Partitions, LoopingEbrChainStops) {
  Bytes disk(kDiskBytes);
  mbr_entry(disk, 0, 0, 0x0f, 2048, 8192);
  mbr_entry(disk, 2048 * 512, 0, 0x83, 64, 64);
  mbr_entry(disk, 2048 * 512, 1, 0x05, 1024, 1024);
  mbr_entry(disk, 3072 * 512, 0, 0x83, 64, 64);
  mbr_entry(disk, 3072 * 512, 1, 0x05, 0, 1024);  // points back at the first EBR: ignored (lba 0)
  Disk d(std::move(disk));
  auto t = run_now(read_partition_table(d.driver));
  ASSERT_TRUE(t.is_ok());
  EXPECT_EQ(t->partitions.size(), 2u);
}

TEST(Partitions, PartitionsAreClippedToTheDisk) {
  Bytes disk(kDiskBytes);
  mbr_entry(disk, 0, 0, 0x83, 16000, 1000);   // runs 616 sectors past the end
  mbr_entry(disk, 0, 1, 0x83, 20000, 100);    // starts past the end
  Disk d(std::move(disk));
  auto t = run_now(read_partition_table(d.driver));
  ASSERT_TRUE(t.is_ok());
  ASSERT_EQ(t->partitions.size(), 1u);
  EXPECT_EQ(t->partitions[0].size, (16384u - 16000) * 512);
}

TEST(Partitions, GptEntriesBySlot) {
  Bytes disk(kDiskBytes);
  mbr_entry(disk, 0, 0, 0xee, 1, 16383);
  std::memcpy(disk.data() + 512, "EFI PART", 8);
  put_le32(disk, 512 + 12, 92);
  put_le64(disk, 512 + 72, 2);    // entries at LBA 2
  put_le32(disk, 512 + 80, 128);  // entries
  put_le32(disk, 512 + 84, 128);  // entry size
  auto entry = [&](int slot, uint64_t first, uint64_t last) {
    size_t e = 1024 + static_cast<size_t>(slot) * 128;
    for (int i = 0; i < 16; ++i) disk[e + static_cast<size_t>(i)] = static_cast<std::byte>(0x10 + i);
    put_le64(disk, e + 32, first);
    put_le64(disk, e + 40, last);
  };
  entry(0, 2048, 4095);
  entry(2, 8192, 16349);
  Disk d(std::move(disk));
  auto t = run_now(read_partition_table(d.driver));
  ASSERT_TRUE(t.is_ok());
  EXPECT_EQ(t->scheme, PartitionScheme::gpt);
  ASSERT_EQ(t->partitions.size(), 2u);
  EXPECT_EQ(t->partitions[0].number, 1u);
  EXPECT_EQ(t->partitions[0].size, 2048u * 512);
  EXPECT_EQ(t->partitions[1].number, 3u);
  EXPECT_EQ(t->partitions[1].offset, 8192u * 512);
  EXPECT_EQ(t->partitions[0].type, "13121110-1514-1716-1819-1a1b1c1d1e1f");
}

TEST(WindowDriver, ShiftsRequestsAndKeepsThemInside) {
  Bytes content(1 << 20);
  for (size_t i = 0; i < content.size(); ++i) content[i] = static_cast<std::byte>(i / 512);
  Disk d(std::move(content));
  WindowDriver w(&d.driver, 4096, 8192);
  EXPECT_EQ(w.size(), 8192u);
  Bytes buf(512);
  ASSERT_TRUE(run_now(w.read(512, buf)).is_ok());
  EXPECT_EQ(buf[0], static_cast<std::byte>((4096 + 512) / 512));
  Bytes data(512, std::byte{0xab});
  ASSERT_TRUE(run_now(w.write(8192 - 512, data)).is_ok());
  EXPECT_EQ(d.file.content()[4096 + 8192 - 1], std::byte{0xab});
  EXPECT_EQ(d.file.content()[4096 + 8192], static_cast<std::byte>((4096 + 8192) / 512));
  EXPECT_EQ(run_now(w.write(8192 - 256, data)).code(), EINVAL);
  EXPECT_EQ(run_now(w.read(8192, buf)).code(), EINVAL);
  EXPECT_EQ(run_now(w.truncate(4096)).code(), EINVAL);
  auto st = run_now(w.block_status(0, 8192));
  ASSERT_TRUE(st.is_ok());
  EXPECT_LE(st->length, 8192u);
}

TEST(WindowDriver, FollowsTheParentsAccessMode) {
  io::MemFileOptions ro;
  ro.writable = false;
  io::MemFile f(ro, Bytes(65536));
  RawDriver parent(&f, false);
  WindowDriver w(&parent, 512, 1024);
  EXPECT_TRUE(w.read_only());
  Bytes data(512);
  EXPECT_EQ(run_now(w.write(0, data)).code(), EROFS);
}

}  // namespace
}  // namespace qcowfs::image
