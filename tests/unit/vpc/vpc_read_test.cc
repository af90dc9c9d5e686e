// The VHD driver over VHD images built in memory (io::MemFile): QEMU 7.2's
// footer search, checksum and size rules, dynamic disks read through the BAT
// with the sector bitmap ignored, block status as qemu-img map prints it,
// fixed disks, differencing disks read as dynamic ones, and refusals.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "image/endian.h"
#include "image/vpc/vpc.h"
#include "io/mem_file.h"
#include "unit/io/io_test_util.h"

namespace qcowfs::image {
namespace {

using io::testing::run_now;
using Bytes = std::vector<std::byte>;

constexpr uint32_t kBlock = 4096;   // bitmap: 512 bytes
constexpr uint32_t kBlocks = 4;
constexpr uint64_t kBatAt = 1536;
constexpr uint64_t kDataAt = 2048;  // first block (its bitmap)

struct Footer {
  uint32_t type = 3;
  uint16_t cyls = 1;
  uint8_t heads = 4;
  uint8_t secs = 8;  // 32 sectors = 16 KiB = kBlocks * kBlock
  uint64_t current_size = kBlocks * kBlock;
  std::string creator = "qemu";
  uint64_t data_offset = 512;
};

void put_footer(Bytes& img, uint64_t at, const Footer& f, bool fix_checksum = true) {
  std::byte* p = img.data() + at;
  std::memset(p, 0, 512);
  std::memcpy(p, "conectix", 8);
  store_be64(p + 16, f.data_offset);
  std::memcpy(p + 28, f.creator.data(), 4);
  store_be64(p + 40, f.current_size);
  store_be64(p + 48, f.current_size);
  store_be16(p + 56, f.cyls);
  p[58] = std::byte{f.heads};
  p[59] = std::byte{f.secs};
  store_be32(p + 60, f.type);
  uint32_t sum = 0;
  for (int i = 0; i < 512; ++i) sum += static_cast<uint8_t>(p[i]);
  if (fix_checksum) store_be32(p + 64, ~sum);
}

// A dynamic disk of kBlocks blocks; `allocated` lists the block placed at
// each data slot, in order (block i of the list at kDataAt + i * (512 + kBlock)).
Bytes dynamic_image(const Footer& f, const std::vector<uint32_t>& allocated) {
  const uint64_t slot = 512 + kBlock;
  Bytes img(kDataAt + allocated.size() * slot + 512);
  put_footer(img, 0, f);
  std::byte* h = img.data() + 512;
  std::memcpy(h, "cxsparse", 8);
  store_be64(h + 8, ~uint64_t{0});
  store_be64(h + 16, kBatAt);
  store_be32(h + 28, kBlocks);
  store_be32(h + 32, kBlock);
  for (uint32_t i = 0; i < kBlocks; ++i) store_be32(img.data() + kBatAt + 4 * i, 0xFFFFFFFF);
  for (size_t i = 0; i < allocated.size(); ++i) {
    const uint64_t at = kDataAt + i * slot;
    store_be32(img.data() + kBatAt + 4 * allocated[i], static_cast<uint32_t>(at / 512));
    // The bitmap stays all zeros ("not present"): QEMU reads the data anyway.
    for (uint32_t b = 0; b < kBlock; ++b) img[at + 512 + b] = std::byte(0x10 + allocated[i]);
  }
  put_footer(img, img.size() - 512, f);
  return img;
}

Result<std::unique_ptr<BlockDriver>> open(Bytes img, ImageOptions opts = {}) {
  io::MemFileOptions mo;
  mo.writable = opts.file.writable;
  return run_now(open_vpc(std::make_unique<io::MemFile>(mo, std::move(img)), "t.vhd", opts));
}

Bytes read_all(BlockDriver& d) {
  Bytes out(d.size());
  EXPECT_TRUE(run_now(d.read(0, out)).is_ok());
  return out;
}

TEST(VpcDynamic, ReadsAllocatedBlocksAndIgnoresTheBitmap) {
  auto d = open(dynamic_image({}, {2, 0}));
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  EXPECT_EQ((*d)->format_name(), "vpc");
  ASSERT_EQ((*d)->size(), kBlocks * kBlock);
  Bytes all = read_all(**d);
  for (uint64_t i = 0; i < all.size(); ++i) {
    const uint64_t block = i / kBlock;
    const std::byte want = block == 0 || block == 2 ? std::byte(0x10 + block) : std::byte{0};
    ASSERT_EQ(all[i], want) << "at " << i;
  }
  EXPECT_EQ((*d)->details().cluster_size, kBlock);
  EXPECT_EQ((*d)->details().dirty, std::optional<bool>(false));
}

TEST(VpcDynamic, BlockStatusIsDataPerBlockAndPresentZeroElsewhere) {
  auto d = open(dynamic_image({}, {0, 1}));
  ASSERT_TRUE(d.is_ok());
  auto first = run_now((*d)->block_status(0, kBlocks * kBlock));
  ASSERT_TRUE(first.is_ok());
  EXPECT_TRUE(first->data && first->present && !first->zero);
  EXPECT_EQ(first->length, kBlock);  // the next block's bitmap breaks the host run
  EXPECT_EQ(first->host_offset, kDataAt + 512);
  auto second = run_now((*d)->block_status(kBlock, 3 * kBlock));
  ASSERT_TRUE(second.is_ok());
  EXPECT_EQ(second->host_offset, kDataAt + 512 + kBlock + 512);
  auto rest = run_now((*d)->block_status(2 * kBlock, 2 * kBlock));
  ASSERT_TRUE(rest.is_ok());
  EXPECT_TRUE(rest->present && rest->zero && !rest->data);
  EXPECT_EQ(rest->length, 2 * kBlock);
}

TEST(VpcSize, CreatorDecidesBetweenGeometryAndCurrentSize) {
  Footer f;
  f.heads = 2;  // CHS: 16 sectors = 8 KiB
  f.current_size = 3 * kBlock + 512;
  auto chs = open(dynamic_image(f, {}));
  ASSERT_TRUE(chs.is_ok());
  EXPECT_EQ((*chs)->size(), 8192u);
  for (const char* app : {"win ", "qem2", "d2v ", "CTXS"}) {
    f.creator = app;
    auto cur = open(dynamic_image(f, {}));
    ASSERT_TRUE(cur.is_ok()) << app;
    EXPECT_EQ((*cur)->size(), 3 * kBlock + 512) << app;
  }
  f.creator = std::string("tap\0", 4);
  EXPECT_EQ((*open(dynamic_image(f, {})))->size(), 3 * kBlock + 512);
  f.creator = "tap ";  // not XenServer's "tap\0": geometry
  EXPECT_EQ((*open(dynamic_image(f, {})))->size(), 8192u);
}

TEST(VpcSize, MaximumGeometryMeansCurrentSize) {
  Footer f;
  f.type = 2;
  f.cyls = 65535;
  f.heads = 16;
  f.secs = 255;
  f.current_size = 8192;
  Bytes img(8192 + 512);
  put_footer(img, 8192, f);
  auto d = open(img);
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  EXPECT_EQ((*d)->size(), 8192u);
}

TEST(VpcSize, PastTwoThousandFortyGibIsRefused) {
  Footer f;
  f.creator = "win ";
  f.current_size = (0xff000000ull + 1) * 512;
  auto d = open(dynamic_image(f, {}));
  ASSERT_FALSE(d.is_ok());
  EXPECT_EQ(d.status().code(), EFBIG);
}

TEST(VpcFooter, BadChecksumIsRefused) {
  Bytes img = dynamic_image({}, {});
  img[30] = std::byte{'X'};
  auto d = open(img);
  ASSERT_FALSE(d.is_ok());
  EXPECT_NE(d.status().message().find("checksum"), std::string::npos) << d.status().message();
}

TEST(VpcFixed, FooterAtTheEndServesTheFileBytes) {
  Footer f;
  f.type = 2;
  Bytes img(kBlocks * kBlock + 512);
  for (size_t i = 0; i < kBlocks * kBlock; ++i) img[i] = std::byte(i * 3);
  put_footer(img, kBlocks * kBlock, f);
  auto d = open(img);
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  Bytes all = read_all(**d);
  EXPECT_TRUE(std::equal(all.begin(), all.end(), img.begin()));
  EXPECT_EQ((*d)->details().cluster_size, 0u);
  auto st = run_now((*d)->block_status(0, kBlock));
  ASSERT_TRUE(st.is_ok());
  EXPECT_TRUE(st->data && st->present);
  EXPECT_EQ(st->host_offset, 0u);
}

TEST(VpcFixed, FooterOnlyAtTheEndMustSayFixed) {
  Footer f;  // dynamic
  Bytes img(kBlocks * kBlock + 512);
  put_footer(img, kBlocks * kBlock, f);
  auto d = open(img);
  ASSERT_FALSE(d.is_ok());
  EXPECT_NE(d.status().message().find("invalid VPC"), std::string::npos);
}

TEST(VpcFixed, FooterCopyAtZeroOfTypeFixedReadsLikeQemu) {
  Footer f;
  f.type = 2;
  Bytes img = dynamic_image(f, {1});
  auto d = open(img);
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  Bytes all = read_all(**d);  // the file's own bytes, footer copy first, zeros past its end
  ASSERT_GT(all.size(), img.size());
  EXPECT_TRUE(std::equal(img.begin(), img.end(), all.begin()));
  EXPECT_TRUE(std::all_of(all.begin() + static_cast<long>(img.size()), all.end(),
                          [](std::byte b) { return b == std::byte{0}; }));
}

TEST(VpcDifferencing, ReadAsADynamicDiskWithoutParent) {
  Footer f;
  f.type = 4;
  auto d = open(dynamic_image(f, {3}));
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  Bytes all = read_all(**d);
  EXPECT_EQ(all[0], std::byte{0});
  EXPECT_EQ(all[3 * kBlock], std::byte{0x13});
  EXPECT_TRUE((*d)->details().backing_file.empty());
}

TEST(VpcRefusals, BlockEndingPastTheFileIsTruncation) {
  Bytes img = dynamic_image({}, {0});
  store_be32(img.data() + kBatAt + 4, 1000);  // block 1 at sector 1000
  auto d = open(img);
  ASSERT_FALSE(d.is_ok());
  EXPECT_NE(d.status().message().find("truncated"), std::string::npos);
}

TEST(VpcRefusals, DynamicHeaderChecks) {
  struct Case {
    size_t field;
    uint32_t value;
    const char* words;
  };
  for (const Case& c : {Case{32, 3000, "block size"}, Case{32, 256, "block size"}, Case{28, 1, "too small"},
                        Case{28, 0x7fffffff, "max_table_entries"}}) {
    Bytes img = dynamic_image({}, {});
    store_be32(img.data() + 512 + c.field, c.value);
    auto d = open(img);
    ASSERT_FALSE(d.is_ok()) << c.words;
    EXPECT_NE(d.status().message().find(c.words), std::string::npos) << d.status().message();
  }
  Bytes img = dynamic_image({}, {});
  store_be64(img.data() + 512 + 16, 1ull << 40);  // BAT offset
  auto d = open(img);
  ASSERT_FALSE(d.is_ok());
  EXPECT_NE(d.status().message().find("BAT"), std::string::npos);
  img = dynamic_image({}, {});
  std::memcpy(img.data() + 512, "cxsparsX", 8);
  EXPECT_FALSE(open(img).is_ok());
}

TEST(VpcRefusals, TinyFileAndReadWriteOpen) {
  EXPECT_FALSE(open(Bytes(100)).is_ok());
  ImageOptions rw;
  rw.file.writable = true;
  Footer differencing;
  differencing.type = 4;  // dynamic disks are writable (vpc_write_test.cc); differencing ones not
  auto d = open(dynamic_image(differencing, {}), rw);
  ASSERT_FALSE(d.is_ok());
  EXPECT_EQ(d.status().code(), EROFS);
}

}  // namespace
}  // namespace qcowfs::image
