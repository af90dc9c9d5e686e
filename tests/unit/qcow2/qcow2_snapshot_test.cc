// Snapshot table parsing: entries with extra data, incremental reads, and
// corrupt tables.
#include <gtest/gtest.h>

#include <cstring>

#include "image/qcow2/snapshot.h"
#include "unit/qcow2/qcow2_test_util.h"

namespace qcowfs::image::qcow2 {
namespace {

using testing::Bytes;

constexpr uint64_t kCs = 65536;

Header header_with_snapshots(uint32_t n) {
  Header h;
  h.cluster_bits = 16;
  h.size = 1ull << 30;
  h.nb_snapshots = n;
  h.snapshots_offset = 8 * kCs;
  return h;
}

void add_entry(Bytes& t, uint64_t l1_off, uint32_t l1_size, const std::string& id, const std::string& name,
               uint64_t disk_size, uint32_t extra_size = 16) {
  size_t at = (t.size() + 7) / 8 * 8;
  t.resize(at + 40 + extra_size + id.size() + name.size());
  std::byte* p = t.data() + at;
  store_be64(p, l1_off);
  store_be32(p + 8, l1_size);
  store_be16(p + 12, static_cast<uint16_t>(id.size()));
  store_be16(p + 14, static_cast<uint16_t>(name.size()));
  store_be32(p + 16, 1700000000);
  store_be32(p + 36, extra_size);
  if (extra_size >= 16) {
    store_be64(p + 40, 12345);
    store_be64(p + 48, disk_size);
  }
  std::memcpy(p + 40 + extra_size, id.data(), id.size());
  std::memcpy(p + 40 + extra_size + id.size(), name.data(), name.size());
}

TEST(Qcow2Snapshot, ParsesEntriesWithExtraData) {
  Bytes t;
  add_entry(t, 4 * kCs, 2, "1", "before-upgrade", 2ull << 30);
  add_entry(t, 5 * kCs, 1, "2", "x", 0, 0);  // no extra data: disk size is the image's
  auto r = parse_snapshot_table(t, header_with_snapshots(2), 16 * kCs);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  ASSERT_EQ(r->needed_bytes, 0u);
  ASSERT_EQ(r->snapshots.size(), 2u);
  EXPECT_EQ(r->snapshots[0].name, "before-upgrade");
  EXPECT_EQ(r->snapshots[0].id, "1");
  EXPECT_EQ(r->snapshots[0].disk_size, 2ull << 30);
  EXPECT_EQ(r->snapshots[0].vm_state_size, 12345u);
  EXPECT_EQ(r->snapshots[1].disk_size, 1ull << 30);
  EXPECT_EQ(find_snapshot(r->snapshots, "x"), 1);
  EXPECT_EQ(find_snapshot(r->snapshots, "1"), 0);
  EXPECT_EQ(find_snapshot(r->snapshots, "nope"), -1);
}

TEST(Qcow2Snapshot, ShortBufferAsksForMoreBytes) {
  Bytes t;
  add_entry(t, 4 * kCs, 2, "1", "a", 1ull << 30);
  add_entry(t, 5 * kCs, 2, "2", "b", 1ull << 30);
  auto r = parse_snapshot_table(std::span<const std::byte>(t).first(60), header_with_snapshots(2), 16 * kCs);
  ASSERT_TRUE(r.is_ok());
  EXPECT_GT(r->needed_bytes, 60u);
  EXPECT_LE(r->needed_bytes, t.size());
}

TEST(Qcow2Snapshot, TableRunningPastEndOfFileIsRefused) {
  Bytes t;
  add_entry(t, 4 * kCs, 2, "1", "a", 1ull << 30);
  auto r = parse_snapshot_table(t, header_with_snapshots(2), 8 * kCs + t.size());
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), EINVAL);
}

TEST(Qcow2Snapshot, OversizedExtraDataIsRefused) {
  Bytes t;
  add_entry(t, 4 * kCs, 2, "1", "a", 1ull << 30, 2048);
  auto r = parse_snapshot_table(t, header_with_snapshots(1), 16 * kCs);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("extra data"), std::string::npos);
}

TEST(Qcow2Snapshot, MisalignedSnapshotL1IsRefused) {
  Bytes t;
  add_entry(t, 4 * kCs + 8, 2, "1", "a", 1ull << 30);
  auto r = parse_snapshot_table(t, header_with_snapshots(1), 16 * kCs);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("L1 table"), std::string::npos);
}

TEST(Qcow2Snapshot, SnapshotL1BeyondEndOfFileIsRefused) {
  Bytes t;
  add_entry(t, 40 * kCs, 2, "1", "a", 1ull << 30);
  auto r = parse_snapshot_table(t, header_with_snapshots(1), 16 * kCs);
  ASSERT_FALSE(r.is_ok());
}

TEST(Qcow2Snapshot, HugeSnapshotL1IsRefused) {
  Bytes t;
  add_entry(t, 4 * kCs, 0x01000000, "1", "a", 1ull << 30);
  auto r = parse_snapshot_table(t, header_with_snapshots(1), 1ull << 40);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("too large"), std::string::npos);
}

}  // namespace
}  // namespace qcowfs::image::qcow2
