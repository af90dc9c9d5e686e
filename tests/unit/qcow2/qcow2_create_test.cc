// qcow2 create (options, validation, layout) checked by reading the result back
// with the header parser and the checker; check/repair on damaged images.
#include <gtest/gtest.h>

#include "image/crypto/luks.h"
#include "image/endian.h"
#include "image/qcow2/qcow2_check.h"
#include "image/luks/luks.h"
#include "image/qcow2/qcow2_create.h"
#include "image/qcow2/qcow2_inspect.h"
#include "image/qcow2/metadata_prealloc.h"
#include "io/align.h"
#include "io/mem_file.h"
#include "unit/io/io_test_util.h"

namespace qcowfs::image::qcow2 {
namespace {

using io::testing::run_now;

Result<CreateOptions> options(std::string_view list) {
  CreateOptions o;
  Status st = apply_create_options(o, list);
  if (!st) return st;
  return validate_create_options(o);
}

CheckReport check(io::MemFile& f, RepairMode mode = RepairMode::none) {
  CheckOptions o;
  o.repair = mode;
  auto r = run_now(check_image(f, o));
  EXPECT_TRUE(r.is_ok()) << r.status().to_string();
  return r.is_ok() ? *r : CheckReport{};
}

std::unique_ptr<io::MemFile> create(std::string_view list, io::MemFile* data = nullptr) {
  auto o = options(list);
  EXPECT_TRUE(o.is_ok()) << o.status().to_string();
  auto f = std::make_unique<io::MemFile>();
  Status st = run_now(write_new_image(*f, data, *o));
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  return f;
}

void expect_clean(const CheckReport& r) {
  EXPECT_EQ(r.corruptions, 0u);
  EXPECT_EQ(r.leaks, 0u);
  EXPECT_EQ(r.check_errors, 0u);
  for (const auto& m : r.messages) ADD_FAILURE() << m;
}

TEST(CreateOptions, SizesTakeBinarySuffixesAndRoundUpToSectors) {
  auto o = options("size=1G,cluster_size=4K");
  ASSERT_TRUE(o.is_ok());
  EXPECT_EQ(o->size, 1ull << 30);
  EXPECT_EQ(o->cluster_size, 4096u);
  EXPECT_EQ(options("size=1000")->size, 1024u);
}

TEST(CreateOptions, RejectsWhatQemuRejects) {
  EXPECT_FALSE(options("size=1M,cluster_size=3000").is_ok());
  EXPECT_FALSE(options("size=1M,cluster_size=4M").is_ok());
  EXPECT_FALSE(options("size=1M,refcount_bits=3").is_ok());
  EXPECT_FALSE(options("size=1M,compat=0.10,lazy_refcounts=on").is_ok());
  EXPECT_FALSE(options("size=1M,compat=0.10,refcount_bits=8").is_ok());
  EXPECT_FALSE(options("size=1M,compat=0.10,compression_type=zstd").is_ok());
  EXPECT_FALSE(options("size=1M,extended_l2=on,cluster_size=4K").is_ok());
  EXPECT_FALSE(options("size=1M,data_file_raw=on").is_ok());
  EXPECT_FALSE(options("size=1M,backing_file=b.img,preallocation=metadata").is_ok());
  EXPECT_FALSE(options("size=1M,backing_file=b.img,data_file=d,data_file_raw=on").is_ok());
  EXPECT_FALSE(options("cluster_size=64K").is_ok()) << "no size and no backing file";
  EXPECT_FALSE(options("size=1M,lazy_refcounts=maybe").is_ok());
  EXPECT_FALSE(options("size=1M,no_such_option=1").is_ok());
  EXPECT_FALSE(options("size=1M,compat").is_ok());
}

TEST(CreateOptions, RawDataFileImpliesMetadataPreallocation) {
  auto o = options("size=1M,data_file=d.raw,data_file_raw=on");
  ASSERT_TRUE(o.is_ok());
  EXPECT_EQ(o->preallocation, Preallocation::metadata);
}

TEST(CreateOptions, BackingWithExtendedL2MayBePreallocated) {
  EXPECT_TRUE(options("size=1M,backing_file=b.img,extended_l2=on,preallocation=metadata").is_ok());
}

TEST(Create, HeaderCarriesEveryOption) {
  auto f = create("size=100M,cluster_size=16K,refcount_bits=8,lazy_refcounts=on,extended_l2=on,compression_type=zstd");
  auto h = run_now(read_qcow2_header(*f));
  ASSERT_TRUE(h.is_ok()) << h.status().to_string();
  EXPECT_EQ(h->version, 3u);
  EXPECT_EQ(h->size, 100ull << 20);
  EXPECT_EQ(h->cluster_size(), 16384u);
  EXPECT_EQ(h->refcount_bits(), 8u);
  EXPECT_TRUE(h->compatible_features & kCompatLazyRefcounts);
  EXPECT_TRUE(h->extended_l2());
  EXPECT_EQ(h->compression_type, kCompressionZstd);
  EXPECT_EQ(h->l1_size, h->l1_entries_for(100ull << 20));
  expect_clean(check(*f));
}

TEST(Create, Version2Image) {
  auto f = create("size=10M,compat=0.10");
  auto h = run_now(read_qcow2_header(*f));
  ASSERT_TRUE(h.is_ok());
  EXPECT_EQ(h->version, 2u);
  EXPECT_EQ(h->refcount_bits(), 16u);
  expect_clean(check(*f));
}

TEST(Create, EveryRefcountWidthChecksClean) {
  for (int bits : {1, 2, 4, 8, 16, 32, 64}) {
    SCOPED_TRACE(bits);
    expect_clean(check(*create(fmt::format("size=64M,cluster_size=4K,refcount_bits={}", bits))));
  }
}

TEST(Create, MetadataPreallocationMapsEveryClusterContiguously) {
  auto f = create("size=8M,cluster_size=64K,preallocation=metadata");
  CheckReport r = check(*f);
  expect_clean(r);
  EXPECT_EQ(r.allocated_clusters, 128u);
  EXPECT_EQ(r.total_clusters, 128u);
  EXPECT_EQ(r.fragmented_clusters, 0u);
}

// qemu-img map tells preallocated images apart by QEMU's refcount heuristic;
// qcowfs map makes the same guess.
TEST(Create, MetadataPreallocationIsDetectedLikeQemu) {
  auto pre = create("size=64M,cluster_size=64K,preallocation=metadata");
  auto h = run_now(read_qcow2_header(*pre));
  ASSERT_TRUE(h.is_ok()) << h.status().to_string();
  auto guess = run_now(detect_metadata_preallocation(*pre, *h));
  ASSERT_TRUE(guess.is_ok()) << guess.status().to_string();
  EXPECT_TRUE(*guess);
  // Write the whole file back as it reads: now the host holds every cluster
  // the refcounts count.
  std::vector<std::byte> all(pre->size());
  ASSERT_TRUE(run_now(pre->read(0, all)).is_ok());
  ASSERT_TRUE(run_now(pre->write(0, all)).is_ok());
  guess = run_now(detect_metadata_preallocation(*pre, *h));
  ASSERT_TRUE(guess.is_ok());
  EXPECT_FALSE(*guess);

  auto plain = create("size=64M,cluster_size=64K");
  auto ph = run_now(read_qcow2_header(*plain));
  ASSERT_TRUE(ph.is_ok());
  guess = run_now(detect_metadata_preallocation(*plain, *ph));
  ASSERT_TRUE(guess.is_ok());
  EXPECT_FALSE(*guess);
}

TEST(Create, ExternalDataFileIsSizedByPreallocation) {
  io::MemFile data;
  auto f = create("size=4M,data_file=d.raw,data_file_raw=on", &data);
  EXPECT_EQ(data.size(), 4u << 20);
  auto h = run_now(read_qcow2_header(*f));
  ASSERT_TRUE(h.is_ok());
  EXPECT_EQ(h->data_file, "d.raw");
  EXPECT_TRUE(h->data_file_raw());
  CheckReport r = check(*f);
  expect_clean(r);
  EXPECT_EQ(r.allocated_clusters, 64u);
}

TEST(Create, BackingFileNameAndFormatAreRecorded) {
  auto f = create("size=1M,backing_file=base.qcow2,backing_fmt=qcow2");
  auto h = run_now(read_qcow2_header(*f));
  ASSERT_TRUE(h.is_ok());
  EXPECT_EQ(h->backing_file, "base.qcow2");
  EXPECT_EQ(h->backing_format, "qcow2");
}

// ---- check and repair on damaged images

uint64_t reftable_entry(io::MemFile& f, const Header& h, size_t i) {
  auto c = f.content();
  return load_be64(c.data() + h.refcount_table_offset + i * 8);
}

void set_refcount(io::MemFile& f, const Header& h, uint64_t cluster, uint64_t value) {
  auto c = f.content();
  uint64_t block = reftable_entry(f, h, 0);
  set_refcount_entry(std::span<std::byte>(c.data() + block, h.cluster_size()), cluster, h.refcount_order, value);
  f.set_content(std::move(c));
}

TEST(Check, FindsAndRepairsALeak) {
  auto f = create("size=16M,cluster_size=4K");
  Header h = *run_now(read_qcow2_header(*f));
  uint64_t end = f->size() / 4096;
  ASSERT_TRUE(run_now(f->truncate((end + 1) * 4096)).is_ok());
  set_refcount(*f, h, end, 1);
  CheckReport r = check(*f);
  EXPECT_EQ(r.leaks, 1u);
  EXPECT_EQ(r.corruptions, 0u);
  CheckReport fixed = check(*f, RepairMode::leaks);
  EXPECT_EQ(fixed.leaks_fixed, 1u);
  EXPECT_EQ(fixed.leaks, 0u);
  expect_clean(check(*f));
}

TEST(Check, MissingRefcountIsACorruptionThatRebuildRepairs) {
  auto f = create("size=16M,cluster_size=4K,preallocation=metadata");
  Header h = *run_now(read_qcow2_header(*f));
  set_refcount(*f, h, f->size() / 4096 - 1, 0);  // the last data cluster
  CheckReport r = check(*f);
  EXPECT_EQ(r.corruptions, 2u) << "refcount below reference, and OFLAG_COPIED now wrong";
  EXPECT_EQ(r.leaks, 0u);
  CheckReport leaks_only = check(*f, RepairMode::leaks);
  EXPECT_GT(leaks_only.corruptions, 0u);
  CheckReport fixed = check(*f, RepairMode::all);
  EXPECT_GT(fixed.corruptions_fixed, 0u);
  expect_clean(check(*f));
}

TEST(Check, RebuildRefcountsMovesTheStructureAndKeepsItConsistent) {
  auto f = create("size=16M,cluster_size=4K,preallocation=metadata");
  Header h = *run_now(read_qcow2_header(*f));
  uint64_t old_table = h.refcount_table_offset;
  ASSERT_TRUE(run_now(rebuild_refcounts(*f, h)).is_ok());
  EXPECT_NE(h.refcount_table_offset, old_table);
  Header reread = *run_now(read_qcow2_header(*f));
  EXPECT_EQ(reread.refcount_table_offset, h.refcount_table_offset);
  EXPECT_EQ(reread.refcount_table_clusters, h.refcount_table_clusters);
  // The old table and blocks are free space now (refcount 0, no references).
  CheckReport r = check(*f);
  expect_clean(r);
  EXPECT_GT(r.image_end_offset, h.refcount_table_offset);
}

TEST(Check, ReadFailureIsACheckErrorNotACrash) {
  auto f = create("size=16M,cluster_size=4K,preallocation=metadata");
  f->fail_from(io::OpKind::read, 6, EIO);
  CheckOptions o;
  auto r = run_now(check_image(*f, o));
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_GT(r->check_errors, 0u);
}

TEST(Check, ProgressEndsAtTheTotal) {
  auto f = create("size=512M,cluster_size=4K");
  CheckOptions o;
  uint64_t calls = 0, last_done = 0, last_total = 0;
  o.progress = [&](uint64_t done, uint64_t total) {
    EXPECT_GE(done, last_done);
    ++calls;
    last_done = done;
    last_total = total;
  };
  auto r = run_now(check_image(*f, o));
  ASSERT_TRUE(r.is_ok());
  EXPECT_GT(calls, 1u);
  EXPECT_EQ(last_done, last_total);
  EXPECT_EQ(last_total, 256u * 4096) << "256 L1 entries (2 MiB each with 4 KiB clusters) map 512 MiB";
}

TEST(Check, RepairNeedsAWritableFile) {
  auto f = create("size=1M");
  io::MemFileOptions ro;
  ro.writable = false;
  io::MemFile copy(ro, f->content());
  CheckOptions o;
  o.repair = RepairMode::all;
  auto r = run_now(check_image(copy, o));
  EXPECT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), EROFS);
}

// ---- encryption (encrypt.format=luks) ----

TEST(CreateEncryption, LuksOptionsTakeQemuNamesAndDefaults) {
  auto o = options("size=1M,encrypt.format=luks,encrypt.key-file=/k,encrypt.cipher-alg=aes-128,"
                   "encrypt.cipher-mode=cbc,encrypt.ivgen-alg=essiv,encrypt.hash-alg=sha512,encrypt.iter-time=10");
  ASSERT_TRUE(o.is_ok()) << o.status().to_string();
  EXPECT_TRUE(o->encrypt);
  EXPECT_EQ(o->luks.key_file, "/k");
  auto p = luks_format_params(o->luks);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_EQ(p->cipher_name, "aes");
  EXPECT_EQ(p->cipher_mode, "cbc-essiv:sha256");
  EXPECT_EQ(p->key_bytes, 16u);
  EXPECT_EQ(p->hash, "sha512");
  EXPECT_EQ(p->iter_time_ms, 10u);
  auto d = luks_format_params(options("size=1M,encrypt.format=luks")->luks);
  ASSERT_TRUE(d.is_ok());
  EXPECT_EQ(d->cipher_mode, "xts-plain64");
  EXPECT_EQ(d->key_bytes, 64u);
  EXPECT_EQ(d->hash, "sha256");
  EXPECT_EQ(d->iter_time_ms, 2000u);
  EXPECT_EQ(d->payload_align, 4096u);
}

TEST(CreateEncryption, RefusesLegacyAesAndBadOptions) {
  for (std::string_view bad : {"encryption=on", "encrypt.format=aes"}) {
    auto o = options(fmt::format("size=1M,{}", bad));
    ASSERT_FALSE(o.is_ok()) << bad;
    EXPECT_NE(o.status().message().find("weak"), std::string::npos) << o.status().message();
  }
  EXPECT_TRUE(options("size=1M,encryption=off").is_ok());
  EXPECT_FALSE(options("size=1M,encrypt.format=twofish").is_ok());
  EXPECT_FALSE(options("size=1M,encrypt.cipher-alg=aes-128").is_ok()) << "encrypt.* without encrypt.format";
  EXPECT_FALSE(options("size=1M,encrypt.format=luks,encrypt.cipher-alg=aes-512").is_ok());
  EXPECT_FALSE(options("size=1M,encrypt.format=luks,encrypt.cipher-mode=gcm").is_ok());
  EXPECT_FALSE(options("size=1M,encrypt.format=luks,encrypt.iter-time=0").is_ok());
  EXPECT_FALSE(options("size=1M,encrypt.format=luks,encrypt.key-secret=s0").is_ok());
  auto o = options("size=1M,encrypt.format=luks,encrypt.hash-alg=sha3");
  ASSERT_FALSE(o.is_ok());
  EXPECT_NE(o.status().message().find("encrypt.hash-alg"), std::string::npos) << o.status().message();
  // XTS needs a 16-byte block cipher: refused when the parameters are made.
  auto c = options("size=1M,encrypt.format=luks,encrypt.cipher-alg=cast5-128");
  ASSERT_TRUE(c.is_ok());
  EXPECT_FALSE(luks_format_params(c->luks).is_ok());
}

TEST(CreateEncryption, RefusesPreallocation) {
  for (std::string_view p : {"metadata", "falloc", "full"}) {
    auto o = options(fmt::format("size=1M,encrypt.format=luks,preallocation={}", p));
    ASSERT_FALSE(o.is_ok()) << p;
    EXPECT_NE(o.status().message().find("noise"), std::string::npos) << o.status().message();
  }
}

// The LUKS area follows the L1 table in whole clusters, is refcounted and named
// by the crypto header extension with the header's own length, as QEMU lays it out.
TEST(CreateEncryption, LuksAreaFollowsTheL1TableInWholeClusters) {
  for (std::string_view cs : {"512", "64K", "2M"}) {
    SCOPED_TRACE(cs);
    auto o = options(fmt::format("size=1G,cluster_size={},encrypt.format=luks", cs));
    ASSERT_TRUE(o.is_ok()) << o.status().to_string();
    std::vector<std::byte> area(2068480, std::byte{0x5a});  // QEMU's payload offset for aes-256-xts
    io::MemFile f;
    Status st = run_now(write_new_image(f, nullptr, *o, area));
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    auto h = run_now(read_qcow2_header(f));
    ASSERT_TRUE(h.is_ok()) << h.status().to_string();
    EXPECT_EQ(h->crypt_method, kCryptLuks);
    ASSERT_TRUE(h->crypto.has_value());
    const uint64_t l1_end = align_up(h->l1_table_offset + uint64_t{h->l1_size} * kL1EntrySize, h->cluster_size());
    EXPECT_EQ(h->crypto->offset, l1_end);
    EXPECT_EQ(h->crypto->length, area.size());
    EXPECT_EQ(f.size(), h->crypto->offset + align_up(area.size(), h->cluster_size()));
    std::vector<std::byte> back(area.size());
    ASSERT_TRUE(run_now(f.read(h->crypto->offset, back)).is_ok());
    EXPECT_EQ(back, area);
    expect_clean(check(f));
  }
}

TEST(CreateEncryption, TheHeaderMustMatchTheOption) {
  io::MemFile f;
  std::vector<std::byte> area(4096);
  EXPECT_FALSE(run_now(write_new_image(f, nullptr, *options("size=1M,encrypt.format=luks"))).is_ok());
  EXPECT_FALSE(run_now(write_new_image(f, nullptr, *options("size=1M"), area)).is_ok());
}

TEST(CreateLuks, RawImageIsTheHeaderThenASparsePayload) {
  LuksCreateOptions l;
  ASSERT_TRUE(apply_luks_create_option(l, "iter-time", "10").is_ok());
  ASSERT_TRUE(apply_luks_create_option(l, "hash-alg", "sha512").is_ok());
  EXPECT_FALSE(apply_luks_create_option(l, "key-secret", "s0").is_ok());
  auto p = luks_format_params(l);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  const std::string pass = "pw";
  auto formatted = crypto::format_luks1(*p, std::as_bytes(std::span(pass)));
  ASSERT_TRUE(formatted.is_ok()) << formatted.status().to_string();
  EXPECT_EQ(formatted->payload_offset, 2068480u) << "qemu-img create -f luks's payload offset";
  io::MemFile f;
  ASSERT_TRUE(run_now(create_luks(f, *formatted, 1000)).is_ok());
  EXPECT_EQ(f.size(), formatted->payload_offset + 1024);
  auto parsed = crypto::parse_luks_header(f.content(), f.size(), "new image");
  ASSERT_TRUE(parsed.is_ok()) << parsed.status().to_string();
  EXPECT_EQ(parsed->payload_offset, formatted->payload_offset);
  EXPECT_EQ(parsed->hash, "sha512");
}

}  // namespace
}  // namespace qcowfs::image::qcow2
