// Header parsing: a valid header per version, each extension, and one
// corruption test per failure mode (named after the scenario).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "image/qcow2/header.h"
#include "unit/qcow2/qcow2_test_util.h"
#include "unit/io/io_test_util.h"

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
  Bytes bytes = io::testing::read_file(path);
  const size_t file_size = bytes.size();
  bytes.resize(std::max<size_t>(bytes.size(), 16384));
  auto h = parse_header(bytes, file_size);
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

// A valid header with some fields overwritten: the scenario, the fields
// (offset, width in bits, value) and what the refusal must say.
struct Poke {
  size_t offset;
  int bits;
  uint64_t value;
};
struct Damage {
  const char* scenario;
  std::vector<Poke> pokes;
  const char* needle;
  int err = EINVAL;
  uint32_t cluster_bits = 16;
};

class Qcow2HeaderDamage : public ::testing::TestWithParam<Damage> {};

TEST_P(Qcow2HeaderDamage, IsRefused) {
  const Damage& d = GetParam();
  HeaderBuilder b(d.cluster_bits);
  for (const Poke& p : d.pokes) {
    if (p.bits == 8) b.bytes[p.offset] = static_cast<std::byte>(p.value);
    else if (p.bits == 32) put32(b.bytes, p.offset, static_cast<uint32_t>(p.value));
    else put64(b.bytes, p.offset, p.value);
  }
  expect_refused(b, d.needle, d.err);
}

// TruncatedExtensionHeader: the backing name starts 4 bytes after the header,
// leaving no room for an extension header.
INSTANTIATE_TEST_SUITE_P(
    Fields, Qcow2HeaderDamage,
    ::testing::Values(
        Damage{"BadMagic", {{0, 32, 0x514649fa}}, "bad magic"},
        Damage{"UnsupportedVersion", {{4, 32, 4}}, "version 4", ENOTSUP},
        Damage{"ClusterBitsBelowMinimum", {{20, 32, 8}}, "cluster_bits 8"},
        Damage{"ClusterBitsAboveMaximum", {{20, 32, 22}}, "cluster_bits 22"},
        Damage{"HeaderLengthBelowMinimum", {{100, 32, 96}}, "header_length 96"},
        Damage{"HeaderLengthNotMultipleOfEight", {{100, 32, 108}}, "header_length 108"},
        Damage{"HeaderLengthBeyondCluster", {{100, 32, 1024}}, "exceeds the cluster size", EINVAL, 9},
        Damage{"RefcountOrderAboveSix", {{96, 32, 7}}, "refcount_order 7"},
        Damage{"L1TableTooSmallForVirtualSize", {{36, 32, 1}}, "too small for virtual size"},
        Damage{"L1TableAboveSizeLimit", {{36, 32, 0x01000000}}, "too large"},
        Damage{"AbsurdVirtualSize", {{24, 64, ~0ull}}, "too large for cluster size", EINVAL, 9},
        Damage{"MisalignedL1Table", {{40, 64, 3 * 65536 + 512}}, "L1 table offset 0x30200 is not cluster aligned"},
        Damage{"L1TableBeyondEndOfFile", {{40, 64, 64 * 65536}}, "L1 table at 0x400000"},
        Damage{"L1TableInHeaderCluster", {{40, 64, 0}}, "in the header"},
        Damage{"MissingRefcountTable", {{56, 32, 0}}, "no refcount table"},
        Damage{"RefcountTableBeyondEndOfFile", {{56, 32, 20}}, "refcount table"},
        Damage{"HugeRefcountTable", {{56, 32, 1000}}, "refcount table of 1000 clusters is too large"},
        Damage{"L1OverlappingRefcountTable", {{40, 64, 65536}}, "overlaps"},
        Damage{"ZstdWithoutCompressionBit", {{104, 8, 1}}, "compression type bit not set"},
        Damage{"CompressionBitWithZlib", {{72, 64, kIncompatCompression}}, "compression type bit set with zlib"},
        Damage{"ExternalDataFileWithoutName", {{72, 64, kIncompatDataFile}}, "does not name it"},
        Damage{"RawDataBitWithoutDataFile", {{88, 64, kAutoclearDataFileRaw}}, "raw external data bit"},
        Damage{"ExtendedL2WithSmallClusters", {{72, 64, kIncompatExtendedL2}}, "extended L2 entries need clusters of at least 16 KiB", EINVAL, 12},
        Damage{"TooManySnapshots", {{60, 32, 70000}, {64, 64, 4 * 65536}}, "70000 snapshots"},
        Damage{"SnapshotTableBeyondEndOfFile", {{60, 32, 1}, {64, 64, 100 * 65536}}, "snapshot table"},
        Damage{"BackingNameOutsideHeaderCluster", {{8, 64, 500}, {16, 32, 20}}, "outside the header cluster", EINVAL, 9},
        Damage{"BackingNameOverlappingFixedHeader", {{8, 64, 64}, {16, 32, 4}}, "outside the header cluster"},
        Damage{"ExtensionRunningPastHeaderArea", {{112, 32, 0x12345678}, {116, 32, 4096}}, "runs past the header area", EINVAL, 9},
        Damage{"TruncatedExtensionHeader", {{112, 32, 0x12345678}, {8, 64, 116}, {16, 32, 4}}, "truncated header extension"}),
    [](const ::testing::TestParamInfo<Damage>& i) { return std::string(i.param.scenario); });

TEST(Qcow2Header, FileShorterThanHeaderIsRefused) {
  HeaderBuilder b;
  auto h = parse_header(std::span<const std::byte>(b.bytes).first(40), 40);
  ASSERT_FALSE(h.is_ok());
  EXPECT_NE(h.status().message().find("too small"), std::string::npos);
}

TEST(Qcow2Header, BackingNameLongerThan1023IsRefused) {
  HeaderBuilder b;
  b.backing(std::string(1024, 'a'));
  expect_refused(b, "backing file name of 1024 bytes");
}

TEST(Qcow2Header, OverlongBackingFormatIsRefused) {
  HeaderBuilder b;
  b.extension(kExtBackingFormat, std::string(16, 'q'));
  expect_refused(b, "backing format name of 16 bytes");
}

TEST(Qcow2Header, UnknownCompressionTypeIsRefused) {
  HeaderBuilder b;
  put64(b.bytes, 72, kIncompatCompression);
  b.bytes[104] = std::byte{7};
  expect_refused(b, "unknown qcow2 compression type 7", ENOTSUP);
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

TEST(Qcow2Header, LuksWithoutItsHeaderExtensionIsRefused) {
  HeaderBuilder b;
  put32(b.bytes, 32, kCryptLuks);
  expect_refused(b, "without the encryption header extension");
}

TEST(Qcow2Header, EncryptionMethodsAreCheckedForWhatTheDriverCanDo) {
  HeaderBuilder b;
  put32(b.bytes, 32, 3);
  auto h = parse(b);
  ASSERT_TRUE(h.is_ok());
  Status st = check_features(*h, false);
  EXPECT_EQ(st.code(), ENOTSUP);
  EXPECT_NE(st.message().find("unknown qcow2 encryption method 3"), std::string::npos) << st.message();
  put32(b.bytes, 32, kCryptAes);
  h = parse(b);
  ASSERT_TRUE(h.is_ok());
  EXPECT_TRUE(check_features(*h, false));
  st = check_features(*h, true);
  EXPECT_EQ(st.code(), EROFS);
  EXPECT_NE(st.message().find("weak"), std::string::npos) << st.message();
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
