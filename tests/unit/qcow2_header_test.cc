// Header parsing: a valid header per version, each extension, and one
// corruption test per failure mode (named after the scenario).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "image/qcow2_header.h"
#include "qcow2_test_util.h"

namespace qcowfs::image::qcow2 {
namespace {

using testing::Bytes;
using testing::HeaderBuilder;
using testing::put32;
using testing::put64;

Result<Header> parse(const HeaderBuilder& b) { return parse_header(b.bytes, b.file_size()); }

void expect_refused(const HeaderBuilder& b, std::string_view needle, int err = EINVAL) {
  auto h = parse(b);
  ASSERT_FALSE(h.is_ok()) << "expected refusal mentioning '" << needle << "'";
  EXPECT_EQ(h.status().code(), err);
  EXPECT_NE(h.status().message().find(needle), std::string::npos) << h.status().message();
}

TEST(Qcow2Header, ParsesValidV3Header) {
  HeaderBuilder b;
  auto h = parse(b);
  ASSERT_TRUE(h.is_ok()) << h.status().to_string();
  EXPECT_EQ(h->version, 3u);
  EXPECT_EQ(h->cluster_size(), 65536u);
  EXPECT_EQ(h->size, 1ull << 30);
  EXPECT_EQ(h->l1_size, 2u);
  EXPECT_EQ(h->l1_table_offset, 3 * 65536u);
  EXPECT_EQ(h->refcount_bits(), 16u);
  EXPECT_EQ(h->l2_entries(), 8192u);
  EXPECT_TRUE(h->backing_file.empty());
  EXPECT_FALSE(h->extended_l2());
  EXPECT_TRUE(check_features(*h, true).is_ok());
}

TEST(Qcow2Header, ParsesValidV2Header) {
  HeaderBuilder b(12, 2);
  b.backing("base.img");
  auto h = parse(b);
  ASSERT_TRUE(h.is_ok()) << h.status().to_string();
  EXPECT_EQ(h->version, 2u);
  EXPECT_EQ(h->header_length, 72u);
  EXPECT_EQ(h->refcount_order, 4u);
  EXPECT_EQ(h->incompatible_features, 0u);
  EXPECT_EQ(h->backing_file, "base.img");
}

TEST(Qcow2Header, ParsesKnownExtensionsAndKeepsUnknownOnes) {
  HeaderBuilder b;
  b.extension(kExtBackingFormat, "raw")
      .extension(kExtDataFile, "data.raw")
      .extension(0x12345678, "opaque!")
      .feature_name(0, 4, "extended l2")
      .backing("../base.raw");
  put64(b.bytes, 72, kIncompatDataFile);
  auto h = parse(b);
  ASSERT_TRUE(h.is_ok()) << h.status().to_string();
  EXPECT_EQ(h->backing_format, "raw");
  EXPECT_EQ(h->data_file, "data.raw");
  EXPECT_EQ(h->backing_file, "../base.raw");
  ASSERT_EQ(h->unknown_extensions.size(), 1u);
  EXPECT_EQ(h->unknown_extensions[0].type, 0x12345678u);
  EXPECT_EQ(h->unknown_extensions[0].data.size(), 7u);
  ASSERT_EQ(h->feature_names.size(), 1u);
  EXPECT_EQ(h->feature_names[0].name, "extended l2");
}

TEST(Qcow2Header, SerialiseRoundTripKeepsEveryField) {
  HeaderBuilder b;
  b.extension(kExtBackingFormat, "qcow2").extension(0x0badf00d, "keep me").feature_name(0, 1, "corrupt");
  b.backing("base.qcow2");
  put64(b.bytes, 80, kCompatLazyRefcounts);
  auto h = parse(b);
  ASSERT_TRUE(h.is_ok()) << h.status().to_string();
  auto bytes = serialize_header(*h);
  ASSERT_TRUE(bytes.is_ok()) << bytes.status().to_string();
  auto again = parse_header(*bytes, b.file_size());
  ASSERT_TRUE(again.is_ok()) << again.status().to_string();
  EXPECT_EQ(again->size, h->size);
  EXPECT_EQ(again->l1_table_offset, h->l1_table_offset);
  EXPECT_EQ(again->compatible_features, kCompatLazyRefcounts);
  EXPECT_EQ(again->backing_file, "base.qcow2");
  EXPECT_EQ(again->backing_format, "qcow2");
  ASSERT_EQ(again->unknown_extensions.size(), 1u);
  EXPECT_EQ(again->unknown_extensions[0].data, h->unknown_extensions[0].data);
  ASSERT_EQ(again->feature_names.size(), 1u);
  EXPECT_EQ(again->feature_names[0].name, "corrupt");
}

TEST(Qcow2Header, UnknownAdditionalHeaderFieldsSurviveRewrite) {
  HeaderBuilder b;
  put32(b.bytes, 100, 128);
  put64(b.bytes, 112, 0x1122334455667788);
  put64(b.bytes, 120, 0x99);
  b.ext_at = 128;
  b.extension(kExtBackingFormat, "raw");
  auto h = parse(b);
  ASSERT_TRUE(h.is_ok()) << h.status().to_string();
  EXPECT_EQ(h->backing_format, "raw");
  ASSERT_EQ(h->unknown_header_fields.size(), 16u);
  auto bytes = serialize_header(*h);
  ASSERT_TRUE(bytes.is_ok());
  EXPECT_EQ(load_be64(bytes->data() + 112), 0x1122334455667788u);
  EXPECT_EQ(load_be64(bytes->data() + 120), 0x99u);
  auto again = parse_header(*bytes, b.file_size());
  ASSERT_TRUE(again.is_ok());
  EXPECT_EQ(again->backing_format, "raw");
}

TEST(Qcow2Header, ParsesHeaderWrittenByQemuImg) {
  const char* path = "/var/tmp/qcowfs_header_test.qcow2";
  std::string cmd = std::string("qemu-img create -q -f qcow2 -o cluster_size=16384,extended_l2=on,compression_type=zstd "
                                "-b /var/tmp/qcowfs_header_test_base.raw -F raw ") + path + " 3G";
  std::ofstream(std::string("/var/tmp/qcowfs_header_test_base.raw")).put('x');
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  std::ifstream in(path, std::ios::binary);
  std::string data((std::istreambuf_iterator<char>(in)), {});
  auto* raw = reinterpret_cast<const std::byte*>(data.data());
  Bytes bytes(raw, raw + data.size());
  bytes.resize(std::max<size_t>(bytes.size(), 16384));
  auto h = parse_header(bytes, data.size());
  std::remove(path);
  std::remove("/var/tmp/qcowfs_header_test_base.raw");
  ASSERT_TRUE(h.is_ok()) << h.status().to_string();
  EXPECT_EQ(h->cluster_size(), 16384u);
  EXPECT_EQ(h->size, 3ull << 30);
  EXPECT_TRUE(h->extended_l2());
  EXPECT_EQ(h->compression_type, kCompressionZstd);
  EXPECT_EQ(h->backing_file, "/var/tmp/qcowfs_header_test_base.raw");
  EXPECT_EQ(h->backing_format, "raw");
  EXPECT_FALSE(h->feature_names.empty());
  EXPECT_TRUE(check_features(*h, false).is_ok());
}

// ---- corruption, one per failure mode ----

TEST(Qcow2Header, BadMagicIsRefused) {
  HeaderBuilder b;
  put32(b.bytes, 0, 0x514649fa);
  expect_refused(b, "bad magic");
}

TEST(Qcow2Header, FileShorterThanHeaderIsRefused) {
  HeaderBuilder b;
  auto h = parse_header(std::span<const std::byte>(b.bytes).first(40), 40);
  ASSERT_FALSE(h.is_ok());
  EXPECT_NE(h.status().message().find("too small"), std::string::npos);
}

TEST(Qcow2Header, UnsupportedVersionIsRefused) {
  HeaderBuilder b;
  put32(b.bytes, 4, 4);
  expect_refused(b, "version 4", ENOTSUP);
}

TEST(Qcow2Header, ClusterBitsBelowMinimumAreRefused) {
  HeaderBuilder b;
  put32(b.bytes, 20, 8);
  expect_refused(b, "cluster_bits 8");
}

TEST(Qcow2Header, ClusterBitsAboveMaximumAreRefused) {
  HeaderBuilder b;
  put32(b.bytes, 20, 22);
  expect_refused(b, "cluster_bits 22");
}

TEST(Qcow2Header, HeaderLengthBelowMinimumIsRefused) {
  HeaderBuilder b;
  put32(b.bytes, 100, 96);
  expect_refused(b, "header_length 96");
}

TEST(Qcow2Header, HeaderLengthNotMultipleOfEightIsRefused) {
  HeaderBuilder b;
  put32(b.bytes, 100, 108);
  expect_refused(b, "header_length 108");
}

TEST(Qcow2Header, HeaderLengthBeyondClusterIsRefused) {
  HeaderBuilder b(9);
  put32(b.bytes, 100, 1024);
  expect_refused(b, "exceeds the cluster size");
}

TEST(Qcow2Header, RefcountOrderAboveSixIsRefused) {
  HeaderBuilder b;
  put32(b.bytes, 96, 7);
  expect_refused(b, "refcount_order 7");
}

TEST(Qcow2Header, L1TableTooSmallForVirtualSizeIsRefused) {
  HeaderBuilder b;
  put32(b.bytes, 36, 1);
  expect_refused(b, "too small for virtual size");
}

TEST(Qcow2Header, L1TableAboveSizeLimitIsRefused) {
  HeaderBuilder b;
  put32(b.bytes, 36, 0x01000000);  // 128 MiB of L1
  expect_refused(b, "too large");
}

TEST(Qcow2Header, AbsurdVirtualSizeIsRefused) {
  HeaderBuilder b(9);
  put64(b.bytes, 24, ~0ull);
  expect_refused(b, "too large for cluster size");
}

TEST(Qcow2Header, MisalignedL1TableIsRefused) {
  HeaderBuilder b;
  put64(b.bytes, 40, 3 * 65536 + 512);
  expect_refused(b, "L1 table offset 0x30200 is not cluster aligned");
}

TEST(Qcow2Header, L1TableBeyondEndOfFileIsRefused) {
  HeaderBuilder b;
  put64(b.bytes, 40, 64 * 65536);
  expect_refused(b, "L1 table at 0x400000");
}

TEST(Qcow2Header, L1TableInHeaderClusterIsRefused) {
  HeaderBuilder b;
  put64(b.bytes, 40, 0);
  expect_refused(b, "in the header");
}

TEST(Qcow2Header, MissingRefcountTableIsRefused) {
  HeaderBuilder b;
  put32(b.bytes, 56, 0);
  expect_refused(b, "no refcount table");
}

TEST(Qcow2Header, RefcountTableBeyondEndOfFileIsRefused) {
  HeaderBuilder b;
  put32(b.bytes, 56, 20);
  expect_refused(b, "refcount table");
}

TEST(Qcow2Header, HugeRefcountTableIsRefused) {
  HeaderBuilder b;
  put32(b.bytes, 56, 1000);  // 64 MiB > 8 MiB limit
  expect_refused(b, "refcount table of 1000 clusters is too large");
}

TEST(Qcow2Header, L1OverlappingRefcountTableIsRefused) {
  HeaderBuilder b;
  put64(b.bytes, 40, 65536);
  expect_refused(b, "overlaps");
}

TEST(Qcow2Header, TooManySnapshotsAreRefused) {
  HeaderBuilder b;
  put32(b.bytes, 60, 70000);
  put64(b.bytes, 64, 4 * 65536);
  expect_refused(b, "70000 snapshots");
}

TEST(Qcow2Header, SnapshotTableBeyondEndOfFileIsRefused) {
  HeaderBuilder b;
  put32(b.bytes, 60, 1);
  put64(b.bytes, 64, 100 * 65536);
  expect_refused(b, "snapshot table");
}

TEST(Qcow2Header, BackingNameLongerThan1023IsRefused) {
  HeaderBuilder b;
  b.backing(std::string(1024, 'a'));
  expect_refused(b, "backing file name of 1024 bytes");
}

TEST(Qcow2Header, BackingNameOutsideHeaderClusterIsRefused) {
  HeaderBuilder b(9);
  put64(b.bytes, 8, 500);
  put32(b.bytes, 16, 20);
  expect_refused(b, "outside the header cluster");
}

TEST(Qcow2Header, BackingNameOverlappingFixedHeaderIsRefused) {
  HeaderBuilder b;
  put64(b.bytes, 8, 64);
  put32(b.bytes, 16, 4);
  expect_refused(b, "outside the header cluster");
}

TEST(Qcow2Header, ExtensionRunningPastHeaderAreaIsRefused) {
  HeaderBuilder b(9);
  put32(b.bytes, 112, 0x12345678);
  put32(b.bytes, 116, 4096);
  expect_refused(b, "runs past the header area");
}

TEST(Qcow2Header, TruncatedExtensionHeaderIsRefused) {
  HeaderBuilder b;
  // The backing name starts 4 bytes after the header: no room for an extension header.
  put32(b.bytes, 112, 0x12345678);
  put64(b.bytes, 8, 116);
  put32(b.bytes, 16, 4);
  expect_refused(b, "truncated header extension");
}

TEST(Qcow2Header, OverlongBackingFormatIsRefused) {
  HeaderBuilder b;
  b.extension(kExtBackingFormat, std::string(16, 'q'));
  expect_refused(b, "backing format name of 16 bytes");
}

TEST(Qcow2Header, ZstdWithoutCompressionBitIsRefused) {
  HeaderBuilder b;
  b.bytes[104] = std::byte{1};
  expect_refused(b, "compression type bit not set");
}

TEST(Qcow2Header, CompressionBitWithZlibIsRefused) {
  HeaderBuilder b;
  put64(b.bytes, 72, kIncompatCompression);
  expect_refused(b, "compression type bit set with zlib");
}

TEST(Qcow2Header, UnknownCompressionTypeIsRefused) {
  HeaderBuilder b;
  put64(b.bytes, 72, kIncompatCompression);
  b.bytes[104] = std::byte{7};
  expect_refused(b, "unknown qcow2 compression type 7", ENOTSUP);
}

TEST(Qcow2Header, ExternalDataFileWithoutNameIsRefused) {
  HeaderBuilder b;
  put64(b.bytes, 72, kIncompatDataFile);
  expect_refused(b, "does not name it");
}

TEST(Qcow2Header, RawDataBitWithoutDataFileIsRefused) {
  HeaderBuilder b;
  put64(b.bytes, 88, kAutoclearDataFileRaw);
  expect_refused(b, "raw external data bit");
}

TEST(Qcow2Header, ExtendedL2WithSmallClustersIsRefused) {
  HeaderBuilder b(12);
  put64(b.bytes, 72, kIncompatExtendedL2);
  expect_refused(b, "extended L2 entries need clusters of at least 16 KiB");
}

TEST(Qcow2Header, BitmapsExtensionOfWrongSizeIsRefused) {
  HeaderBuilder b;
  b.extension(kExtBitmaps, Bytes(16));
  expect_refused(b, "bitmaps extension of 16 bytes");
}

TEST(Qcow2Header, ConsistentBitmapsExtensionOutsideFileIsRefused) {
  HeaderBuilder b;
  Bytes ext(24);
  store_be32(ext.data(), 1);
  store_be64(ext.data() + 8, 4096);
  store_be64(ext.data() + 16, 1000 * 65536ull);
  b.extension(kExtBitmaps, ext);
  put64(b.bytes, 88, kAutoclearBitmaps);
  expect_refused(b, "bitmap directory");
}

TEST(Qcow2Header, EncryptionHeaderExtensionOfWrongSizeIsRefused) {
  HeaderBuilder b;
  b.extension(kExtCryptoHeader, Bytes(8));
  expect_refused(b, "encryption header extension of 8 bytes");
}

// ---- features ----

TEST(Qcow2Header, EncryptedImageIsRefusedNamingTheMethod) {
  HeaderBuilder b;
  put32(b.bytes, 32, kCryptLuks);
  auto h = parse(b);
  ASSERT_TRUE(h.is_ok());
  Status st = check_features(*h, false);
  EXPECT_EQ(st.code(), ENOTSUP);
  EXPECT_NE(st.message().find("LUKS"), std::string::npos) << st.message();
}

TEST(Qcow2Header, UnknownIncompatibleBitIsRefusedWithItsTableName) {
  HeaderBuilder b;
  b.feature_name(0, 9, "time travel");
  put64(b.bytes, 72, 1ull << 9);
  auto h = parse(b);
  ASSERT_TRUE(h.is_ok());
  Status st = check_features(*h, false);
  EXPECT_EQ(st.code(), ENOTSUP);
  EXPECT_NE(st.message().find("time travel"), std::string::npos) << st.message();
}

TEST(Qcow2Header, UnknownIncompatibleBitWithoutTableIsRefusedByNumber) {
  HeaderBuilder b;
  put64(b.bytes, 72, 1ull << 40);
  auto h = parse(b);
  ASSERT_TRUE(h.is_ok());
  Status st = check_features(*h, false);
  EXPECT_EQ(st.code(), ENOTSUP);
  EXPECT_NE(st.message().find("unknown feature bit 40"), std::string::npos) << st.message();
}

TEST(Qcow2Header, CorruptImageOpensOnlyReadOnly) {
  HeaderBuilder b;
  put64(b.bytes, 72, kIncompatCorrupt);
  auto h = parse(b);
  ASSERT_TRUE(h.is_ok());
  EXPECT_TRUE(check_features(*h, false).is_ok());
  EXPECT_EQ(check_features(*h, true).code(), EROFS);
}

TEST(Qcow2Header, DirtyImageIsReadable) {
  HeaderBuilder b;
  put64(b.bytes, 72, kIncompatDirty);
  auto h = parse(b);
  ASSERT_TRUE(h.is_ok());
  EXPECT_TRUE(h->dirty());
  EXPECT_TRUE(check_features(*h, false).is_ok());
}

TEST(Qcow2Header, UnknownCompatibleAndAutoclearBitsAreIgnored) {
  HeaderBuilder b;
  put64(b.bytes, 80, 1ull << 30);
  put64(b.bytes, 88, 1ull << 20);
  auto h = parse(b);
  ASSERT_TRUE(h.is_ok()) << h.status().to_string();
  EXPECT_TRUE(check_features(*h, false).is_ok());
}

}  // namespace
}  // namespace qcowfs::image::qcow2
