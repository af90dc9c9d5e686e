// L2 entry decoding: the classifier (kind, host cluster, COPIED, subcluster
// states; what the reader, the writer and check rely on), every cluster and
// subcluster run type, compressed descriptors, and one test per corrupt-entry
// failure mode.
#include <gtest/gtest.h>

#include "image/qcow2/l2.h"

namespace qcowfs::image::qcow2 {
namespace {

constexpr uint64_t kCs = 65536;

Geometry standard() { return Geometry{16, false, false, 64 * kCs}; }
Geometry extended() { return Geometry{16, true, false, 64 * kCs}; }

void expect_corrupt(const Result<ClusterRun>& r, std::string_view needle) {
  ASSERT_FALSE(r.is_ok()) << "expected EIO mentioning '" << needle << "'";
  EXPECT_EQ(r.status().code(), EIO);
  EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().message();
}

TEST(Qcow2L2, NormalClusterMapsToHostOffset) {
  auto r = decode_cluster_run(standard(), kOflagCopied | 5 * kCs, 0, 100, 400);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->kind, ExtentKind::data);
  EXPECT_EQ(r->host_offset, 5 * kCs + 100);
  EXPECT_EQ(r->length, 400u);
}

TEST(Qcow2L2, UnallocatedClusterReadsFromBacking) {
  auto r = decode_cluster_run(standard(), 0, 0, 0, kCs);
  ASSERT_TRUE(r.is_ok());
  EXPECT_EQ(r->kind, ExtentKind::unallocated);
  EXPECT_EQ(r->length, kCs);
}

TEST(Qcow2L2, ZeroPlainAndZeroAllocReadAsZeros) {
  auto plain = decode_cluster_run(standard(), kOflagZero, 0, 0, kCs);
  auto alloc = decode_cluster_run(standard(), kOflagZero | kOflagCopied | 7 * kCs, 0, 0, kCs);
  ASSERT_TRUE(plain.is_ok());
  ASSERT_TRUE(alloc.is_ok());
  EXPECT_EQ(plain->kind, ExtentKind::zero);
  EXPECT_EQ(alloc->kind, ExtentKind::zero);
}

TEST(Qcow2L2, ExternalDataFileOffsetZeroWithCopiedIsData) {
  Geometry g = standard();
  g.external_data = true;
  auto r = decode_cluster_run(g, kOflagCopied, 0, 0, kCs);
  ASSERT_TRUE(r.is_ok());
  EXPECT_EQ(r->kind, ExtentKind::data);
  EXPECT_EQ(r->host_offset, 0u);
  auto unalloc = decode_cluster_run(g, 0, 0, 0, kCs);
  ASSERT_TRUE(unalloc.is_ok());
  EXPECT_EQ(unalloc->kind, ExtentKind::unallocated);
}

TEST(Qcow2L2, CompressedDescriptorDecodesOffsetAndSize) {
  // cluster_bits 16: x = 62 - 8 = 54; 3 additional sectors; offset 0x50123.
  uint64_t entry = kOflagCompressed | (uint64_t{3} << 54) | 0x50123;
  CompressedCluster c = decode_compressed(16, entry);
  EXPECT_EQ(c.host_offset, 0x50123u);
  EXPECT_EQ(c.size, 4 * 512u - 0x123u);
  auto r = decode_cluster_run(standard(), entry, 0, 10, 20);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->kind, ExtentKind::compressed);
  EXPECT_EQ(r->length, 20u);
  EXPECT_EQ(r->compressed.host_offset, 0x50123u);
}

TEST(Qcow2L2, CompressedDescriptorAt512ByteClusters) {
  // cluster_bits 9: x = 61, one bit of sector count.
  uint64_t entry = kOflagCompressed | (uint64_t{1} << 61) | 0x1000;
  CompressedCluster c = decode_compressed(9, entry);
  EXPECT_EQ(c.host_offset, 0x1000u);
  EXPECT_EQ(c.size, 1024u);
}

TEST(Qcow2L2, L1EntryDecodesL2Offset) {
  auto r = decode_l1_entry(standard(), kOflagCopied | 4 * kCs);
  ASSERT_TRUE(r.is_ok());
  EXPECT_EQ(*r, 4 * kCs);
  auto none = decode_l1_entry(standard(), 0);
  ASSERT_TRUE(none.is_ok());
  EXPECT_EQ(*none, 0u);
}

// ---- corruption ----

TEST(Qcow2L2, L1EntryWithReservedBitsIsCorrupt) {
  auto r = decode_l1_entry(standard(), 4 * kCs | 1);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), EIO);
}

TEST(Qcow2L2, MisalignedL2TableIsCorrupt) {
  auto r = decode_l1_entry(standard(), 4 * kCs + 4096);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("not cluster aligned"), std::string::npos);
}

TEST(Qcow2L2, L2TableBeyondEndOfFileIsCorrupt) {
  auto r = decode_l1_entry(standard(), 64 * kCs);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("beyond the end"), std::string::npos);
}

TEST(Qcow2L2, L2EntryWithReservedBitsIsCorrupt) {
  expect_corrupt(decode_cluster_run(standard(), 5 * kCs | (1ull << 57), 0, 0, kCs), "reserved bits");
  expect_corrupt(decode_cluster_run(standard(), 5 * kCs | 2, 0, 0, kCs), "reserved bits");
}

TEST(Qcow2L2, ZeroFlagWithExtendedL2IsCorrupt) {
  expect_corrupt(decode_cluster_run(extended(), kOflagZero, 0, 0, kCs), "reserved bits");
}

TEST(Qcow2L2, MisalignedDataClusterIsCorrupt) {
  expect_corrupt(decode_cluster_run(standard(), 5 * kCs + 512, 0, 0, kCs), "not cluster aligned");
}

TEST(Qcow2L2, DataClusterBeyondEndOfFileIsCorrupt) {
  expect_corrupt(decode_cluster_run(standard(), 100 * kCs, 0, 0, kCs), "beyond the end of the image file");
}

TEST(Qcow2L2, ZeroAllocPointingPastEndOfFileIsCorrupt) {
  expect_corrupt(decode_cluster_run(standard(), kOflagZero | 100 * kCs, 0, 0, kCs), "beyond the end");
}

TEST(Qcow2L2, CompressedClusterInHeaderIsCorrupt) {
  expect_corrupt(decode_cluster_run(standard(), kOflagCompressed | 0x100, 0, 0, kCs), "into the image header");
}

TEST(Qcow2L2, CompressedClusterPastEndOfFileIsCorrupt) {
  // Starts inside the file but its sectors run 3 KiB past the end.
  uint64_t entry = kOflagCompressed | (uint64_t{7} << 54) | (64 * kCs - 1024);
  expect_corrupt(decode_cluster_run(standard(), entry, 0, 0, kCs), "past the end of the image file");
}

TEST(Qcow2L2, CompressedClusterEndingInLastPartialSectorIsFine) {
  Geometry g = standard();
  g.image_file_size = 64 * kCs - 100;  // file ends inside the stream's last sector
  uint64_t entry = kOflagCompressed | (uint64_t{1} << 54) | (64 * kCs - 1024);
  auto r = decode_cluster_run(g, entry, 0, 0, kCs);
  EXPECT_TRUE(r.is_ok()) << r.status().to_string();
}

TEST(Qcow2L2, CompressedClusterWithExternalDataFileIsCorrupt) {
  Geometry g = standard();
  g.external_data = true;
  expect_corrupt(decode_cluster_run(g, kOflagCompressed | 5 * kCs, 0, 0, kCs), "external data file");
}

TEST(Qcow2L2, CompressedClusterWithSubclusterBitmapIsCorrupt) {
  expect_corrupt(decode_cluster_run(extended(), kOflagCompressed | 5 * kCs, 1, 0, kCs), "subcluster bitmap");
}

// ---- subclusters (64 KiB clusters: 2 KiB subclusters) ----

TEST(Qcow2L2, SubclustersSplitClusterIntoRuns) {
  constexpr uint64_t sc = kCs / 32;
  // Subclusters 0-1 allocated, 2 zero, 3.. unallocated.
  uint64_t bitmap = 0b11 | (uint64_t{1} << (32 + 2));
  uint64_t entry = kOflagCopied | 5 * kCs;
  auto a = decode_cluster_run(extended(), entry, bitmap, 0, kCs);
  ASSERT_TRUE(a.is_ok()) << a.status().to_string();
  EXPECT_EQ(a->kind, ExtentKind::data);
  EXPECT_EQ(a->length, 2 * sc);
  EXPECT_EQ(a->host_offset, 5 * kCs);
  auto z = decode_cluster_run(extended(), entry, bitmap, 2 * sc + 10, kCs - 2 * sc - 10);
  ASSERT_TRUE(z.is_ok());
  EXPECT_EQ(z->kind, ExtentKind::zero);
  EXPECT_EQ(z->length, sc - 10);
  auto u = decode_cluster_run(extended(), entry, bitmap, 3 * sc, kCs - 3 * sc);
  ASSERT_TRUE(u.is_ok());
  EXPECT_EQ(u->kind, ExtentKind::unallocated);
  EXPECT_EQ(u->length, kCs - 3 * sc);
}

TEST(Qcow2L2, SubclusterRunStopsAtMaxLength) {
  auto r = decode_cluster_run(extended(), kOflagCopied | 5 * kCs, 0xffffffffu, 100, 1000);
  ASSERT_TRUE(r.is_ok());
  EXPECT_EQ(r->kind, ExtentKind::data);
  EXPECT_EQ(r->length, 1000u);
  EXPECT_EQ(r->host_offset, 5 * kCs + 100);
}

TEST(Qcow2L2, ZeroSubclustersOfUnallocatedCluster) {
  auto r = decode_cluster_run(extended(), 0, uint64_t{0xffffffff} << 32, 0, kCs);
  ASSERT_TRUE(r.is_ok());
  EXPECT_EQ(r->kind, ExtentKind::zero);
  EXPECT_EQ(r->length, kCs);
}

TEST(Qcow2L2, SubclusterBothAllocatedAndZeroIsCorrupt) {
  uint64_t bitmap = 0b100 | (uint64_t{0b100} << 32);
  expect_corrupt(decode_cluster_run(extended(), 5 * kCs, bitmap, 0, kCs), "both allocated and zero");
}

TEST(Qcow2L2, AllocatedSubclusterWithoutHostClusterIsCorrupt) {
  expect_corrupt(decode_cluster_run(extended(), 0, 1, 0, kCs), "unallocated cluster has allocated subclusters");
}

// ---- classify_l2_entry / decode_l2_entry ----

L2EntryClass classify_ok(const Geometry& g, uint64_t entry, uint64_t bitmap = 0) {
  auto c = classify_l2_entry(g, entry, bitmap);
  EXPECT_TRUE(c.is_ok()) << c.status().to_string();
  return c.is_ok() ? *c : L2EntryClass{};
}

void expect_class_corrupt(const Result<L2EntryClass>& r, std::string_view needle) {
  ASSERT_FALSE(r.is_ok()) << "expected EIO mentioning '" << needle << "'";
  EXPECT_EQ(r.status().code(), EIO);
  EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().message();
}

TEST(Qcow2L2Classify, NormalCopiedClusterIsOwned) {
  L2EntryClass c = classify_ok(standard(), kOflagCopied | 5 * kCs);
  EXPECT_EQ(c.kind, L2Kind::normal);
  EXPECT_TRUE(c.allocated);
  EXPECT_TRUE(c.copied);
  EXPECT_TRUE(c.owned());
  EXPECT_TRUE(c.mapped());
  EXPECT_EQ(c.host, 5 * kCs);
  EXPECT_EQ(c.subcluster(0), SubclusterState::data);
}

TEST(Qcow2L2Classify, SharedClusterIsNotOwned) {
  L2EntryClass c = classify_ok(standard(), 5 * kCs);  // refcount > 1 (a snapshot shares it)
  EXPECT_EQ(c.kind, L2Kind::normal);
  EXPECT_TRUE(c.allocated);
  EXPECT_FALSE(c.owned());
}

TEST(Qcow2L2Classify, UnallocatedEntry) {
  L2EntryClass c = classify_ok(standard(), 0);
  EXPECT_EQ(c.kind, L2Kind::unallocated);
  EXPECT_FALSE(c.allocated);
  EXPECT_FALSE(c.mapped());
  EXPECT_EQ(c.subcluster(0), SubclusterState::unallocated);
}

TEST(Qcow2L2Classify, ZeroPlainHasNoHostCluster) {
  L2EntryClass c = classify_ok(standard(), kOflagZero);
  EXPECT_EQ(c.kind, L2Kind::zero);
  EXPECT_FALSE(c.allocated);
  EXPECT_FALSE(c.mapped());
  EXPECT_EQ(c.subcluster(0), SubclusterState::zero);
}

TEST(Qcow2L2Classify, ZeroAllocKeepsItsHostCluster) {
  L2EntryClass c = classify_ok(standard(), kOflagZero | kOflagCopied | 7 * kCs);
  EXPECT_EQ(c.kind, L2Kind::zero);
  EXPECT_TRUE(c.allocated);
  EXPECT_TRUE(c.owned());
  EXPECT_TRUE(c.mapped());
  EXPECT_EQ(c.host, 7 * kCs);
}

TEST(Qcow2L2Classify, ExternalDataOffsetZeroWithCopiedIsAllocated) {
  Geometry g = standard();
  g.external_data = true;
  L2EntryClass data = classify_ok(g, kOflagCopied);
  EXPECT_EQ(data.kind, L2Kind::normal);
  EXPECT_TRUE(data.allocated);
  EXPECT_TRUE(data.mapped());
  EXPECT_EQ(data.host, 0u);
  // Without COPIED, offset 0 is unallocated even in a data file.
  EXPECT_EQ(classify_ok(g, 0).kind, L2Kind::unallocated);
  // A zero entry at offset 0 names the data file's cluster 0 for the writer,
  // but reads do not map it (QEMU: only a non-zero offset is ZERO_ALLOC).
  L2EntryClass zero = classify_ok(g, kOflagZero | kOflagCopied);
  EXPECT_EQ(zero.kind, L2Kind::zero);
  EXPECT_TRUE(zero.allocated);
  EXPECT_FALSE(zero.mapped());
}

TEST(Qcow2L2Classify, CompressedDescriptorIsNeverAllocated) {
  uint64_t entry = kOflagCompressed | (uint64_t{3} << 54) | 0x50123;
  L2EntryClass c = classify_ok(standard(), entry);
  EXPECT_EQ(c.kind, L2Kind::compressed);
  EXPECT_FALSE(c.allocated);
  EXPECT_FALSE(c.owned());
  EXPECT_FALSE(c.mapped());
  EXPECT_EQ(c.host, 0u);
  EXPECT_EQ(c.compressed.host_offset, 0x50123u);
  EXPECT_EQ(c.compressed.size, 4 * 512u - 0x123u);
}

TEST(Qcow2L2Classify, ExtendedSubclusterStates) {
  // Subcluster 0 allocated, 1 zero, 2 unallocated, 31 allocated.
  uint64_t bitmap = 1 | (uint64_t{1} << 31) | (uint64_t{0b10} << kSubclusterZeroShift);
  L2EntryClass c = classify_ok(extended(), kOflagCopied | 5 * kCs, bitmap);
  EXPECT_EQ(c.kind, L2Kind::normal);
  EXPECT_EQ(c.alloc_bits(), 0x80000001u);
  EXPECT_EQ(c.zero_bits(), 0b10u);
  EXPECT_EQ(c.subcluster(0), SubclusterState::data);
  EXPECT_EQ(c.subcluster(1), SubclusterState::zero);
  EXPECT_EQ(c.subcluster(2), SubclusterState::unallocated);
  EXPECT_EQ(c.subcluster(31), SubclusterState::data);
}

TEST(Qcow2L2Classify, ExtendedUnallocatedClusterWithZeroSubclusters) {
  L2EntryClass c = classify_ok(extended(), 0, uint64_t{1} << (kSubclusterZeroShift + 4));
  EXPECT_EQ(c.kind, L2Kind::unallocated);
  EXPECT_EQ(c.subcluster(4), SubclusterState::zero);
  EXPECT_EQ(c.subcluster(5), SubclusterState::unallocated);
}

TEST(Qcow2L2Classify, BitmapIgnoredWithoutExtendedL2) {
  L2EntryClass c = classify_ok(standard(), kOflagCopied | 5 * kCs, ~uint64_t{0});
  EXPECT_EQ(c.bitmap, 0u);
  EXPECT_EQ(c.subcluster(3), SubclusterState::data);
}

TEST(Qcow2L2Classify, CorruptEntriesNameTheProblem) {
  expect_class_corrupt(classify_l2_entry(standard(), 5 * kCs | 2, 0), "reserved bits");
  expect_class_corrupt(classify_l2_entry(extended(), kOflagZero | 5 * kCs, 1), "reserved bits");
  expect_class_corrupt(classify_l2_entry(standard(), 5 * kCs + 512, 0), "not cluster aligned");
  expect_class_corrupt(classify_l2_entry(standard(), 100 * kCs, 0), "beyond the end");
  expect_class_corrupt(classify_l2_entry(standard(), kOflagZero | 100 * kCs, 0), "beyond the end");
  expect_class_corrupt(classify_l2_entry(extended(), 5 * kCs, 0b1 | (uint64_t{0b1} << 32)), "both allocated and zero");
  expect_class_corrupt(classify_l2_entry(extended(), 0, 0b1), "allocated subclusters");
  expect_class_corrupt(classify_l2_entry(extended(), kOflagCompressed | 5 * kCs, 1), "subcluster bitmap");
}

TEST(Qcow2L2Classify, CopiedOffsetZeroOutsideADataFileIsUnallocated) {
  L2EntryClass c = classify_ok(standard(), kOflagCopied);
  EXPECT_EQ(c.kind, L2Kind::unallocated);
  EXPECT_FALSE(c.allocated);
  EXPECT_FALSE(c.owned());
}

TEST(Qcow2L2Classify, DecodeWithoutValidationStillDecodes) {
  // check reports these itself: the decoded fields must still be right.
  L2EntryClass misaligned = decode_l2_entry(standard(), kOflagCopied | (5 * kCs + 512), 0);
  EXPECT_EQ(misaligned.kind, L2Kind::normal);
  EXPECT_EQ(misaligned.host, 5 * kCs + 512);
  L2EntryClass both = decode_l2_entry(extended(), 5 * kCs, 1 | (uint64_t{1} << 32));
  EXPECT_EQ(both.alloc_bits() & both.zero_bits(), 1u);
  // With extended L2 the zero flag is reserved and does not make a zero cluster.
  EXPECT_EQ(decode_l2_entry(extended(), kOflagZero, 0).kind, L2Kind::unallocated);
  EXPECT_EQ(decode_l2_entry(extended(), kOflagZero | 5 * kCs, 0).kind, L2Kind::normal);
}

TEST(Qcow2L2Classify, ClusterRunFollowsTheClass) {
  L2EntryClass c = classify_ok(standard(), kOflagZero | kOflagCopied | 7 * kCs);
  ClusterRun r = cluster_run(standard(), c, 100, 50);
  EXPECT_EQ(r.kind, ExtentKind::zero);
  EXPECT_TRUE(r.mapped);
  EXPECT_EQ(r.host_offset, 7 * kCs + 100);
  EXPECT_EQ(r.length, 50u);
}

}  // namespace
}  // namespace qcowfs::image::qcow2
