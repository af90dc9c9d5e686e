// The VDI reader over synthetic images in memory: header checks in QEMU's
// order and wording, the sector rounding of odd disk sizes, block map entry
// classification (data, unallocated and discarded as present zeros, corrupt
// entries as EIO), runs of consecutive data blocks as one extent, and the
// bounded block map read.
#include <gtest/gtest.h>

#include <cstring>

#include "image/endian.h"
#include "image/vdi/format.h"
#include "image/vdi/vdi.h"
#include "io/run_sync.h"
#include "unit/image/driver_test_fixtures.h"

namespace qcowfs::image {
namespace {

using Bytes = std::vector<std::byte>;
constexpr uint64_t kBlock = 1 << 20;
constexpr uint64_t kBmap = 512;
constexpr uint64_t kData = 1024;

// A dynamic VDI of 6 blocks: blocks 0 and 1 in data blocks 0 and 1, block 2
// in data block 3, block 3 discarded, blocks 4-5 unallocated; data block 2
// unused. Data block i is filled with 0x30 + i.
struct Image {
  Bytes b = Bytes(kData + 4 * kBlock);
  Image() {
    std::memcpy(b.data(), "<<< QEMU VM Virtual Disk Image >>>\n", 35);
    u32(64, vdi::kSignature);
    u32(68, vdi::kVersion1_1);
    u32(72, 0x180);
    u32(76, vdi::kTypeDynamic);
    u32(340, kBmap);
    u32(344, kData);
    u32(360, 512);
    u64(368, 6 * kBlock);
    u32(376, kBlock);
    u32(384, 6);
    u32(388, 4);
    const uint32_t map[6] = {0, 1, 3, vdi::kDiscarded, vdi::kUnallocated, vdi::kUnallocated};
    for (size_t i = 0; i < 6; ++i) u32(kBmap + 4 * i, map[i]);
    for (size_t i = 0; i < 4; ++i) std::memset(b.data() + kData + i * kBlock, static_cast<int>(0x30 + i), kBlock);
  }
  void u32(size_t at, uint32_t v) { store_le32(b.data() + at, v); }
  void u64(size_t at, uint64_t v) { store_le64(b.data() + at, v); }
};

class Vdi : public testing::MemReadTest<Image> {
 protected:
  Vdi() : MemReadTest(open_vdi, "/tmp/t.vdi") {}
};

TEST_F(Vdi, ReadsBlocksThroughTheBlockMap) {
  Image img;
  auto d = open_ok(img);
  ASSERT_TRUE(d);
  EXPECT_EQ(d->size(), 6 * kBlock);
  Bytes buf(6 * kBlock);
  ASSERT_TRUE(read(*d, 0, buf).is_ok());
  EXPECT_EQ(buf[0], std::byte{0x30});
  EXPECT_EQ(buf[kBlock + 5], std::byte{0x31});
  EXPECT_EQ(buf[2 * kBlock + 5], std::byte{0x33});  // block 2 -> data block 3
  EXPECT_EQ(buf[3 * kBlock + 5], std::byte{0});     // discarded
  EXPECT_EQ(buf[5 * kBlock + 5], std::byte{0});     // unallocated
}

TEST_F(Vdi, StatusMatchesQemuMap) {
  Image img;
  auto d = open_ok(img);
  ASSERT_TRUE(d);
  auto s = status(*d, 4096, 6 * kBlock - 4096);
  ASSERT_TRUE(s.is_ok());
  EXPECT_EQ(s->length, 2 * kBlock - 4096);  // data blocks 0 and 1 follow each other
  EXPECT_TRUE(s->data && s->present && !s->zero);
  EXPECT_EQ(s->host_offset, kData + 4096);
  auto z = status(*d, 3 * kBlock, 3 * kBlock);
  ASSERT_TRUE(z.is_ok());
  EXPECT_EQ(z->length, 3 * kBlock);  // discarded and unallocated alike
  EXPECT_TRUE(z->zero && z->present && !z->data);
}

TEST_F(Vdi, OddDiskSizeIsRoundedUpToASector) {
  Image img;
  img.u64(368, 5 * kBlock + 100);
  auto d = open_ok(img);
  ASSERT_TRUE(d);
  EXPECT_EQ(d->size(), 5 * kBlock + 512);
}

TEST_F(Vdi, HeaderRefusalsInQemuOrder) {
  auto with = [](auto patch) { Image i; patch(i); return i; };
  auto has = [&](const Image& i, const char* text) { return refusal(i).find(text) != std::string::npos; };
  EXPECT_TRUE(has(with([](Image& i) { i.u64(368, 1ull << 60); }), "Unsupported VDI image size"));
  EXPECT_TRUE(has(with([](Image& i) { i.u32(64, 0); }), "bad signature 00000000"));
  EXPECT_TRUE(has(with([](Image& i) { i.u32(68, 0x00020001); }), "(version 2.1)"));
  EXPECT_TRUE(has(with([](Image& i) { i.u32(340, 513); }), "unaligned block map offset 0x201"));
  EXPECT_TRUE(has(with([](Image& i) { i.u32(344, 1000); }), "unaligned data offset"));
  EXPECT_TRUE(has(with([](Image& i) { i.u32(360, 4096); }), "sector size 4096 is not 512"));
  EXPECT_TRUE(has(with([](Image& i) { i.u32(376, 2 * kBlock); }), "block size 2097152 is not 1048576"));
  EXPECT_TRUE(has(with([](Image& i) { i.u32(384, 5); }), "image bitmap has room for"));
  EXPECT_TRUE(has(with([](Image& i) { i.b[430] = std::byte{1}; }), "non-NULL link UUID"));
  EXPECT_TRUE(has(with([](Image& i) { i.b[450] = std::byte{1}; }), "non-NULL parent UUID"));
  EXPECT_TRUE(has(with([](Image& i) { i.u32(384, 0x40000000); }), "too many blocks"));
  EXPECT_TRUE(has(with([](Image& i) { i.u32(340, 0x7ffffe00); }), "block map"));
}

TEST_F(Vdi, CorruptEntriesReadAsEio) {
  Image img;
  img.u32(kBmap + 4, 6);  // block 1 -> data block 6: not below blocks_in_image
  auto d = open_ok(img);
  ASSERT_TRUE(d);
  Bytes buf(4096);
  EXPECT_EQ(read(*d, kBlock, buf).code(), EIO);
  ASSERT_TRUE(read(*d, 0, buf).is_ok());
  EXPECT_EQ(buf[0], std::byte{0x30});
  auto s = status(*d, 0, kBlock);
  ASSERT_TRUE(s.is_ok());
  EXPECT_EQ(s->length, kBlock);
  EXPECT_EQ(status(*d, kBlock, kBlock).status().code(), EIO);
}

TEST_F(Vdi, DetailsAndWritableOpen) {
  Image img;
  auto d = open_ok(img);
  ASSERT_TRUE(d);
  EXPECT_EQ(d->details().cluster_size, kBlock);
  EXPECT_EQ(d->details().dirty, std::optional<bool>(false));
  ImageOptions rw;
  rw.file.writable = true;
  auto w = open(img, rw);
  ASSERT_TRUE(w.is_ok()) << w.status().to_string();
  EXPECT_FALSE((*w)->read_only());
  EXPECT_TRUE(io::run_sync(*engine_, (*w)->close()).is_ok());
}

}  // namespace
}  // namespace qcowfs::image
