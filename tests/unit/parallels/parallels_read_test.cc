// The Parallels driver over images built in memory (io::MemFile): QEMU 7.2's
// header checks, BAT units for both magics, host-contiguous clusters as one
// block-status run, unallocated clusters "present": false, the format
// extension's checks, a BAT entry past the end of the file (EIO), refusals.
#include <gcrypt.h>
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "image/crypto/cipher.h"
#include "image/endian.h"
#include "image/parallels/parallels.h"
#include "io/mem_file.h"
#include "unit/io/io_test_util.h"

namespace qcowfs::image {
namespace {

using io::testing::run_now;
using Bytes = std::vector<std::byte>;

constexpr uint32_t kTracks = 8;  // 4 KiB clusters
constexpr uint64_t kCluster = kTracks * 512;
constexpr uint32_t kEntries = 6;

// Header + BAT in cluster 0; data clusters from cluster 1. bat[i] is the host
// cluster of guest cluster i (0: unallocated); host cluster c holds 0x20 + c.
Bytes image(const std::vector<uint32_t>& bat, bool old_magic = false, uint64_t host_clusters = 5) {
  Bytes img(host_clusters * kCluster);
  std::memcpy(img.data(), old_magic ? "WithoutFreeSpace" : "WithouFreSpacExt", 16);
  store_le32(img.data() + 16, 2);
  store_le32(img.data() + 28, kTracks);
  store_le32(img.data() + 32, kEntries);
  store_le64(img.data() + 36, kEntries * kTracks);
  store_le32(img.data() + 48, kTracks);
  for (size_t i = 0; i < bat.size(); ++i)
    store_le32(img.data() + 64 + 4 * i, old_magic ? bat[i] * kTracks : bat[i]);
  for (uint64_t c = 1; c < host_clusters; ++c)
    std::memset(img.data() + c * kCluster, 0x20 + static_cast<int>(c), kCluster);
  return img;
}

Result<std::unique_ptr<BlockDriver>> open(Bytes img, ImageOptions opts = {}) {
  io::MemFileOptions mo;
  mo.writable = opts.file.writable;
  return run_now(open_parallels(std::make_unique<io::MemFile>(mo, std::move(img)), "t.hds", opts));
}

std::byte at(BlockDriver& d, uint64_t off) {
  std::byte b[1];
  EXPECT_TRUE(run_now(d.read(off, b)).is_ok());
  return b[0];
}

void expect_refused(Bytes img, const char* words) {
  auto d = open(std::move(img));
  ASSERT_FALSE(d.is_ok()) << words;
  EXPECT_NE(d.status().message().find(words), std::string::npos) << d.status().message();
}

TEST(Parallels, ReadsClustersThroughTheBat) {
  auto d = open(image({2, 1, 0, 4}));
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  EXPECT_EQ((*d)->format_name(), "parallels");
  EXPECT_EQ((*d)->size(), kEntries * kCluster);
  EXPECT_EQ(at(**d, 0), std::byte{0x22});
  EXPECT_EQ(at(**d, kCluster + 5), std::byte{0x21});
  EXPECT_EQ(at(**d, 2 * kCluster), std::byte{0});
  EXPECT_EQ(at(**d, 3 * kCluster + kCluster - 1), std::byte{0x24});
  EXPECT_EQ(at(**d, 5 * kCluster), std::byte{0});
  EXPECT_EQ((*d)->details().cluster_size, 0u);  // qemu-img shows none
  EXPECT_FALSE((*d)->details().dirty.has_value());
}

TEST(Parallels, OldMagicCountsBatEntriesInSectors) {
  auto d = open(image({3, 0, 1}, true));
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  EXPECT_EQ(at(**d, 10), std::byte{0x23});
  EXPECT_EQ(at(**d, 2 * kCluster), std::byte{0x21});
}

TEST(Parallels, BlockStatusMergesHostContiguousClusters) {
  auto d = open(image({1, 2, 3, 0, 0, 4}));
  ASSERT_TRUE(d.is_ok());
  auto run = run_now((*d)->block_status(0, kEntries * kCluster));
  ASSERT_TRUE(run.is_ok());
  EXPECT_TRUE(run->data && run->present);
  EXPECT_EQ(run->length, 3 * kCluster);
  EXPECT_EQ(run->host_offset, kCluster);
  auto hole = run_now((*d)->block_status(3 * kCluster, 3 * kCluster));
  ASSERT_TRUE(hole.is_ok());
  EXPECT_FALSE(hole->present || hole->data);
  EXPECT_EQ(hole->length, 2 * kCluster);
}

TEST(Parallels, BatEntryPastTheEndIsEioForItsClusterOnly) {
  auto d = open(image({1, 1000}));
  ASSERT_TRUE(d.is_ok());
  std::byte b[16];
  auto bad = run_now((*d)->read(kCluster, b));
  EXPECT_EQ(bad.code(), EIO);
  EXPECT_EQ(at(**d, 0), std::byte{0x21});
}

TEST(Parallels, EmptyBatReadsZeros) {
  Bytes img = image({});
  store_le32(img.data() + 32, 0);
  auto d = open(img);
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  EXPECT_EQ(at(**d, 5), std::byte{0});
}

TEST(Parallels, InUseImageOpensReadOnly) {
  Bytes img = image({1});
  store_le32(img.data() + 44, 0x746F6E59);
  EXPECT_TRUE(open(img).is_ok());
  ImageOptions rw;
  rw.file.writable = true;
  auto d = open(img, rw);
  ASSERT_FALSE(d.is_ok());
  EXPECT_EQ(d.status().code(), EROFS);
}

TEST(Parallels, HeaderRefusals) {
  Bytes img = image({});
  store_le32(img.data() + 16, 3);
  expect_refused(img, "not in Parallels format");
  img = image({});
  img[3] = std::byte{'x'};
  expect_refused(img, "not in Parallels format");
  img = image({});
  store_le32(img.data() + 28, 0);
  expect_refused(img, "zero sectors");
  img = image({});
  store_le32(img.data() + 28, 0x7fffffff / 513 + 1);
  expect_refused(img, "too big cluster");
  img = image({});
  store_le32(img.data() + 32, 0x7fffffff / 4 + 1);
  expect_refused(img, "catalog too large");
  img = image({});
  store_le64(img.data() + 36, ~uint64_t{0});
  expect_refused(img, "too large");
}

TEST(Parallels, BatEntriesPastTheFileAreUnallocated) {
  Bytes img = image({1}, false, 2);
  store_le32(img.data() + 32, 100000);  // most of this BAT lies past the 8 KiB file
  store_le64(img.data() + 36, 100000 * kTracks);
  auto d = open(img);
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  EXPECT_EQ(at(**d, 0), std::byte{0x21});
  EXPECT_EQ(at(**d, 99999 * kCluster), std::byte{0});
}

// Records the MD5 of the extension cluster at host cluster 4 in its header.
Bytes sealed(Bytes img) {
  std::byte* ext = img.data() + 4 * kCluster;
  crypto::init_gcrypt();
  gcry_md_hash_buffer(GCRY_MD_MD5, ext + 8, ext + 24, kCluster - 24);
  return img;
}

// An extension cluster at host cluster 4: its magic, then features.
Bytes with_extension(uint64_t feature_magic, uint32_t data_size = 0) {
  Bytes img = image({1});
  store_le64(img.data() + 56, 4 * kTracks);
  std::byte* ext = img.data() + 4 * kCluster;
  std::memset(ext, 0, kCluster);
  store_le64(ext, 0xAB234CEF23DCEA87ull);
  store_le64(ext + 24, feature_magic);
  store_le32(ext + 24 + 16, data_size);
  return img;
}

TEST(Parallels, FormatExtension) {
  EXPECT_TRUE(open(sealed(with_extension(0))).is_ok());               // end of features at once
  expect_refused(with_extension(0), "checksum");                     // not sealed
  Bytes bitmap = with_extension(0x20385FAE252CB34Aull, 64);  // a dirty bitmap, then the end
  store_le64(bitmap.data() + 4 * kCluster + 48, kEntries * kTracks);
  store_le32(bitmap.data() + 4 * kCluster + 48 + 28, 4);
  EXPECT_TRUE(open(sealed(bitmap)).is_ok());
  store_le64(bitmap.data() + 4 * kCluster + 48, 7);
  expect_refused(sealed(bitmap), "differs from disk size");
  Bytes flags = with_extension(0);
  store_le64(flags.data() + 4 * kCluster + 32, 1);
  expect_refused(sealed(flags), "flags");
  expect_refused(sealed(with_extension(0x1234)), "unknown");
  expect_refused(sealed(with_extension(0x20385FAE252CB34Aull, 1 << 20)), "out of cluster");
  Bytes img = with_extension(0);
  img[4 * kCluster] = std::byte{0};
  expect_refused(img, "extension magic");
}

}  // namespace
}  // namespace qcowfs::image
