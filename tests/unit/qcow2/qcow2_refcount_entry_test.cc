// Refcount entries at every width (1..64 bits): round trips that leave the
// neighbours alone, the bit and byte layout qemu-img writes, and the largest
// value each width holds; RefcountMap's location of a host cluster's refcount.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "image/qcow2/refcount_entry.h"

namespace qcowfs::image::qcow2 {
namespace {

TEST(Qcow2RefcountEntry, MaxRefcountAtEveryWidth) {
  const uint64_t expected[] = {0x1, 0x3, 0xf, 0xff, 0xffff, 0xffffffff, ~uint64_t{0}};
  for (uint32_t order = 0; order <= 6; ++order) EXPECT_EQ(max_refcount(order), expected[order]) << order;
}

TEST(Qcow2RefcountEntry, EveryWidthRoundTripsWithoutTouchingNeighbours) {
  for (uint32_t order = 0; order <= 6; ++order) {
    SCOPED_TRACE(order);
    std::vector<std::byte> block(128, std::byte{0});
    uint64_t entries = block.size() * 8 >> order;
    uint64_t maxv = max_refcount(order);
    auto value = [&](uint64_t i) { return (i * 0x9e3779b97f4a7c15ull + 5) & maxv; };
    for (uint64_t i = 0; i < entries; ++i) set_refcount_entry(block, i, order, value(i));
    for (uint64_t i = 0; i < entries; ++i) ASSERT_EQ(get_refcount_entry(block, i, order), value(i)) << i;
    set_refcount_entry(block, 3, order, maxv);
    EXPECT_EQ(get_refcount_entry(block, 3, order), maxv);
    EXPECT_EQ(get_refcount_entry(block, 2, order), value(2));
    EXPECT_EQ(get_refcount_entry(block, 4, order), value(4));
  }
}

TEST(Qcow2RefcountEntry, SetKeepsOnlyTheBitsOfItsWidth) {
  for (uint32_t order = 0; order <= 6; ++order) {
    SCOPED_TRACE(order);
    std::vector<std::byte> block(64, std::byte{0});
    set_refcount_entry(block, 5, order, ~uint64_t{0});
    EXPECT_EQ(get_refcount_entry(block, 5, order), max_refcount(order));
    EXPECT_EQ(get_refcount_entry(block, 4, order), 0u);
    EXPECT_EQ(get_refcount_entry(block, 6, order), 0u);
    size_t set_bytes = static_cast<size_t>(std::count_if(block.begin(), block.end(), [](std::byte b) {
      return b != std::byte{0};
    }));
    EXPECT_EQ(set_bytes, order >= 3 ? size_t{1} << (order - 3) : 1u);
  }
}

TEST(Qcow2RefcountEntry, SubByteWidthsPutEntryZeroInTheLowBits) {
  std::vector<std::byte> b(8, std::byte{0});
  set_refcount_entry(b, 0, 0, 1);
  EXPECT_EQ(b[0], std::byte{0x01});
  set_refcount_entry(b, 7, 0, 1);
  EXPECT_EQ(b[0], std::byte{0x81});
  std::fill(b.begin(), b.end(), std::byte{0});
  set_refcount_entry(b, 1, 1, 2);
  EXPECT_EQ(b[0], std::byte{0x08});
  std::fill(b.begin(), b.end(), std::byte{0});
  set_refcount_entry(b, 1, 2, 0xa);
  EXPECT_EQ(b[0], std::byte{0xa0});
}

TEST(Qcow2RefcountEntry, WholeByteWidthsAreBigEndian) {
  std::vector<std::byte> b(32, std::byte{0});
  set_refcount_entry(b, 1, 3, 0x12);
  EXPECT_EQ(b[1], std::byte{0x12});
  std::fill(b.begin(), b.end(), std::byte{0});
  set_refcount_entry(b, 1, 4, 0x1234);
  EXPECT_EQ(b[2], std::byte{0x12});
  EXPECT_EQ(b[3], std::byte{0x34});
  std::fill(b.begin(), b.end(), std::byte{0});
  set_refcount_entry(b, 1, 5, 0x12345678);
  EXPECT_EQ(b[4], std::byte{0x12});
  EXPECT_EQ(b[7], std::byte{0x78});
  std::fill(b.begin(), b.end(), std::byte{0});
  set_refcount_entry(b, 1, 6, 0x0102030405060708);
  EXPECT_EQ(b[8], std::byte{0x01});
  EXPECT_EQ(b[15], std::byte{0x08});
}

// ---- RefcountMap ----

TEST(Qcow2RefcountMap, LocatesAHostClustersRefcount) {
  const RefcountMap map(16, 4);  // 64 KiB clusters, 16-bit refcounts: 32768 per block
  EXPECT_EQ(map.block_entries(), 32768u);
  EXPECT_EQ(map.table_index(32767), 0u);
  EXPECT_EQ(map.table_index(32768), 1u);
  EXPECT_EQ(map.entry_index(32768 + 5), 5u);
  EXPECT_EQ(RefcountMap(9, 0).block_entries(), 4096u);  // 512 B clusters, 1-bit refcounts
  EXPECT_EQ(RefcountMap(9, 6).block_entries(), 64u);    // 64-bit refcounts
}

TEST(Qcow2RefcountMap, BlockOffsetMasksAndStopsAtTheTableEnd) {
  const RefcountMap map(16, 4);
  const std::vector<uint64_t> table = {0x30000 | 0x1ff, 0};
  EXPECT_EQ(map.block_offset(table, 3), 0x30000u);  // reserved low bits dropped
  EXPECT_EQ(map.block_offset(table, 32768), 0u);    // empty entry
  EXPECT_EQ(map.block_offset(table, 2 * 32768), 0u);  // past the table
}

TEST(Qcow2RefcountMap, GetAndSetUseTheEntryInsideTheBlock) {
  const RefcountMap map(9, 2);  // 4-bit refcounts, 1024 per block
  std::vector<std::byte> block(512);
  map.set(block, 1024 + 3, 0xa);  // host cluster 1027 is entry 3 of block 1
  EXPECT_EQ(get_refcount_entry(block, 3, 2), 0xau);
  EXPECT_EQ(map.get(block, 3), 0xau);  // the same entry of block 0
  EXPECT_EQ(map.get(block, 2), 0u);
  EXPECT_EQ(map.max(), 15u);
}

TEST(Qcow2RefcountMap, StructureSizes) {
  const RefcountMap map(16, 4);
  EXPECT_EQ(map.blocks_for(0), 0u);
  EXPECT_EQ(map.blocks_for(1), 1u);
  EXPECT_EQ(map.blocks_for(32768), 1u);
  EXPECT_EQ(map.blocks_for(32769), 2u);
  EXPECT_EQ(map.table_clusters_for(0), 0u);
  EXPECT_EQ(map.table_clusters_for(8192), 1u);  // 8192 entries of 8 bytes: one 64 KiB cluster
  EXPECT_EQ(map.table_clusters_for(8193), 2u);
}

}  // namespace
}  // namespace qcowfs::image::qcow2
