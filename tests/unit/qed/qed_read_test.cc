// The QED reader over synthetic images in memory: header checks in QEMU's
// order and wording (including its refusal of one-cluster tables), L1/L2
// entry classification (unallocated, zero cluster, data, corrupt), runs of
// contiguous clusters as one extent, and what info shows.
#include <gtest/gtest.h>

#include <cstring>

#include "image/endian.h"
#include "image/qed/format.h"
#include "image/qed/header.h"
#include "image/qed/qed.h"
#include "unit/image/driver_test_fixtures.h"

namespace qcowfs::image {
namespace {

using Bytes = std::vector<std::byte>;
constexpr uint64_t kCluster = 4096;
constexpr uint64_t kL1 = kCluster;          // L1 at cluster 1 (2 clusters: table_size 2)
constexpr uint64_t kL2 = 3 * kCluster;      // one L2 table at clusters 3-4
constexpr uint64_t kData = 5 * kCluster;    // data clusters from cluster 5
constexpr uint64_t kSize = 16ull << 20;     // 16 MiB; one L2 table maps 4 MiB

// A QED image: 4 KiB clusters, 2-cluster tables (1024 entries), L1[0] -> kL2,
// data clusters 0..3 at kData.. (guest clusters 0-2 contiguous, 3 elsewhere),
// guest cluster 4 a zero cluster, the rest unallocated.
struct Image {
  Bytes b = Bytes(12 * kCluster);
  Image() {
    store_le32(b.data(), qed::kMagic);
    store_le32(b.data() + 4, kCluster);
    store_le32(b.data() + 8, 2);
    store_le32(b.data() + 12, 1);
    store_le64(b.data() + 40, kL1);
    store_le64(b.data() + 48, kSize);
    store_le64(b.data() + kL1, kL2);
    for (uint64_t i = 0; i < 3; ++i) l2(i, kData + i * kCluster);
    l2(3, kData + 5 * kCluster);
    l2(4, qed::kZeroCluster);
    for (uint64_t c = 0; c < 6; ++c) std::memset(b.data() + kData + c * kCluster, static_cast<int>(0x10 + c), kCluster);
  }
  void l2(uint64_t index, uint64_t v) { store_le64(b.data() + kL2 + index * 8, v); }
  void u32(size_t at, uint32_t v) { store_le32(b.data() + at, v); }
  void u64(size_t at, uint64_t v) { store_le64(b.data() + at, v); }
};

class Qed : public testing::MemReadTest<Image> {
 protected:
  Qed() : MemReadTest(open_qed, "/tmp/t.qed") {}
};

TEST_F(Qed, ReadsDataZeroAndUnallocatedClusters) {
  Image img;
  auto d = open_ok(img);
  ASSERT_TRUE(d);
  EXPECT_EQ(d->size(), kSize);
  Bytes buf(6 * kCluster);
  ASSERT_TRUE(read(*d, 0, buf).is_ok());
  for (uint64_t c = 0; c < 3; ++c) EXPECT_EQ(buf[c * kCluster + 7], std::byte(0x10 + c));
  EXPECT_EQ(buf[3 * kCluster], std::byte{0x15});  // guest cluster 3 -> host data cluster 5
  EXPECT_EQ(buf[4 * kCluster + 100], std::byte{0});
  EXPECT_EQ(buf[5 * kCluster + 100], std::byte{0});
}

TEST_F(Qed, ContiguousClustersAreOneExtentAndKindsMatchQemuMap) {
  Image img;
  auto d = open_ok(img);
  ASSERT_TRUE(d);
  auto s = status(*d, 512, kSize - 512);
  ASSERT_TRUE(s.is_ok());
  EXPECT_EQ(s->length, 3 * kCluster - 512);
  EXPECT_TRUE(s->data && s->present && !s->zero);
  EXPECT_EQ(s->host_offset, kData + 512);
  auto z = status(*d, 4 * kCluster, kCluster);
  ASSERT_TRUE(z.is_ok());
  EXPECT_TRUE(z->zero && z->present && !z->data);  // zero cluster: "present": true
  auto u = status(*d, 5 * kCluster, kSize - 5 * kCluster);
  ASSERT_TRUE(u.is_ok());
  EXPECT_TRUE(u->zero && !u->present && !u->data);  // unallocated, no backing: "present": false
  EXPECT_EQ(u->length, kSize - 5 * kCluster);       // through the empty L1 entries too
}

TEST_F(Qed, OneClusterTablesAreRefusedLikeQemu) {
  Image img;
  img.u32(8, 1);
  EXPECT_NE(refusal(img).find("QED table offset is invalid"), std::string::npos);
}

TEST_F(Qed, HeaderRefusalsInQemuOrder) {
  auto with = [](auto patch) { Image i; patch(i); return i; };
  EXPECT_NE(refusal(with([](Image& i) { i.u32(0, 0x1234); })).find("Image not in QED format"), std::string::npos);
  EXPECT_NE(refusal(with([](Image& i) { i.u64(16, 0x100); })).find("Unsupported QED features: 100"),
            std::string::npos);
  EXPECT_NE(refusal(with([](Image& i) { i.u32(4, 3000); })).find("cluster size is invalid"), std::string::npos);
  EXPECT_NE(refusal(with([](Image& i) { i.u32(8, 3); })).find("table size is invalid"), std::string::npos);
  EXPECT_NE(refusal(with([](Image& i) { i.u64(48, kSize + 1); })).find("image size is invalid"), std::string::npos);
  EXPECT_NE(refusal(with([](Image& i) { i.u64(48, 1ull << 40); })).find("image size is invalid"), std::string::npos);
  EXPECT_NE(refusal(with([](Image& i) { i.u64(40, 1ull << 40); })).find("table offset is invalid"),
            std::string::npos);
  EXPECT_NE(refusal(with([](Image& i) { i.u32(12, 0x80000000); })).find("table offset is invalid"),
            std::string::npos);  // the L1 table now lies inside the "header"
  EXPECT_NE(refusal(with([](Image& i) {
              i.u64(16, qed::kFeatureBackingFile);
              i.u32(56, 4000);
              i.u32(60, 200);
            })).find("backing filename offset is invalid"),
            std::string::npos);
}

TEST_F(Qed, MaxImageSizeWrapsAsInQemu) {
  EXPECT_EQ(qed::max_image_size(64 * 1024, 4), 1ull << 46);
  EXPECT_EQ(qed::max_image_size(2 * 1024 * 1024, 16), 0u);  // 2^65 wraps: QEMU accepts only size 0
}

TEST_F(Qed, BadEntriesReadAsEio) {
  Image past;
  past.l2(0, 1ull << 40);
  auto d = open_ok(past);
  ASSERT_TRUE(d);
  Bytes buf(512);
  EXPECT_EQ(read(*d, 0, buf).code(), EIO);
  EXPECT_TRUE(read(*d, kCluster, buf).is_ok());

  Image unaligned;
  unaligned.l2(1, kData + 512);
  d = open_ok(unaligned);
  ASSERT_TRUE(d);
  EXPECT_EQ(read(*d, kCluster, buf).code(), EIO);
  Bytes first(kCluster);
  ASSERT_TRUE(read(*d, 0, first).is_ok());
  EXPECT_EQ(first[0], std::byte{0x10});

  Image bad_l1;
  bad_l1.u64(kL1, 7 * kCluster + 1);
  d = open_ok(bad_l1);
  ASSERT_TRUE(d);
  EXPECT_EQ(read(*d, 0, buf).code(), EIO);
}

TEST_F(Qed, Details) {
  Image img;
  img.u64(16, qed::kFeatureNeedCheck);
  auto d = open_ok(img);
  ASSERT_TRUE(d);
  ImageDetails det = d->details();
  EXPECT_EQ(det.cluster_size, kCluster);
  EXPECT_EQ(det.dirty, std::optional<bool>(false));  // as qemu-img info shows it (DESIGN.md)
  EXPECT_TRUE(det.backing_file.empty());
}

TEST_F(Qed, BackingNameEndsAtNulAndRawFormatIsRecorded) {
  Image img;
  img.u64(16, qed::kFeatureBackingFile | qed::kFeatureBackingFormatNoProbe);
  img.u32(56, 64);
  img.u32(60, 16);
  std::memcpy(img.b.data() + 64, "base.raw\0junk", 13);
  ImageOptions opts;
  opts.no_backing = true;
  auto d = open(img, opts);
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  EXPECT_EQ((*d)->details().backing_file, "base.raw");
  EXPECT_EQ((*d)->details().backing_format, "raw");
}

}  // namespace
}  // namespace qcowfs::image
