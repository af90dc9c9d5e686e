// The qcow2 driver over real images made with qemu-img/qemu-io in /var/tmp:
// every byte read through the driver must equal `qemu-img convert -O raw`,
// through read() and as a mount reads (mapped reads where the driver gives
// them).
// Also: snapshots (vs `qemu-img convert -l`), backing chains, loops, external
// data files, block status, corrupt metadata and a tiny L2 cache under
// concurrent readers.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "image/block_driver.h"
#include "image/endian.h"
#include "image/qcow2/driver.h"
#include "io/engine.h"
#include "io/run_sync.h"
#include "io/when_all.h"
#include "unit/image/mapped_read_util.h"
#include "unit/image/qemu_dir_test.h"
#include "unit/io/io_test_util.h"

namespace qcowfs::image {
namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<std::byte>;

class Qcow2Image : public testing::QemuDirTest {
 protected:
  Qcow2Image() : QemuDirTest("qcowfs_qcow2_image_test_") {}

  static Bytes slurp(const std::string& p) { return io::testing::read_file(p); }

  Result<std::unique_ptr<BlockDriver>> open(const std::string& name, ImageOptions opts = {}) {
    return io::run_sync(*engine_, open_image(path(name), std::move(opts)));
  }

  // Reads the whole image in `chunk`-byte requests, eight at a time.
  Result<Bytes> read_all(BlockDriver& d, size_t chunk) {
    return io::run_sync(*engine_, read_all_task(d, chunk));
  }
  static Task<Result<Bytes>> read_all_task(BlockDriver& d, size_t chunk) {
    Bytes out(d.size());
    for (uint64_t off = 0; off < d.size();) {
      std::vector<Task<Status>> batch;
      for (int i = 0; i < 8 && off < d.size(); ++i) {
        size_t n = static_cast<size_t>(std::min<uint64_t>(chunk, d.size() - off));
        batch.push_back(d.read(off, std::span<std::byte>(out.data() + off, n)));
        off += n;
      }
      Status st = co_await io::when_all(std::move(batch));
      if (!st) co_return st;
    }
    co_return out;
  }

  // Opens `name`, compares every byte with qemu-img convert -O raw, using
  // several request sizes (including unaligned ones).
  void expect_same_as_qemu(const std::string& name, ImageOptions opts = {}) {
    sh("qemu-img convert -O raw " + name + " " + name + ".ref");
    Bytes ref = slurp(path(name + ".ref"));
    auto d = open(name, opts);
    ASSERT_TRUE(d.is_ok()) << d.status().to_string();
    ASSERT_EQ((*d)->size(), ref.size());
    for (size_t chunk : {size_t{1} << 20, size_t{65536}, size_t{4096}, size_t{12345}}) {
      if (chunk < 65536 && ref.size() > (64u << 20)) continue;  // keep small requests cheap
      auto got = read_all(**d, chunk);
      ASSERT_TRUE(got.is_ok()) << got.status().to_string();
      ASSERT_TRUE(*got == ref) << name << " differs from qemu-img convert with " << chunk << "-byte reads";
    }
    mapped_ = 0;
    for (size_t chunk : {size_t{65536}, size_t{4096}, size_t{12345}}) {
      if (chunk < 65536 && ref.size() > (64u << 20)) continue;
      auto got = io::run_sync(*engine_, testing::read_all_as_mounted(**d, chunk, &mapped_));
      ASSERT_TRUE(got.is_ok()) << got.status().to_string();
      ASSERT_TRUE(*got == ref) << name << " differs from qemu-img convert with " << chunk << "-byte reads as mounted";
    }
  }

  // Writes a mix of patterns, partial clusters, zeroes and unmapped zeroes.
  void scribble(const std::string& name, const std::string& fmt = "qcow2") {
    sh("qemu-io -f " + fmt + " -c 'write -P 0x11 0 300k' -c 'write -P 0x22 1000k 5k' "
       "-c 'write -P 0x33 2047k 3k' -c 'write -z 200k 64k' -c 'write -z -u 4m 128k' "
       "-c 'write -P 0x44 5m 1m' -c 'write -P 0x55 9m 512' " + name);
  }

  size_t mapped_ = 0;  // mapped reads in expect_same_as_qemu()'s last image
};

TEST_F(Qcow2Image, ClusterSizesMatchQemu) {
  for (const char* cs : {"512", "4k", "64k", "2M"}) {
    std::string name = std::string("cs") + cs + ".qcow2";
    sh(std::string("qemu-img create -q -f qcow2 -o cluster_size=") + cs + " " + name + " 12M");
    scribble(name);
    expect_same_as_qemu(name);
    EXPECT_GT(mapped_, 0u) << name;  // its data clusters are read as host runs
  }
}

TEST_F(Qcow2Image, RefcountWidthsAndV2MatchQemu) {
  sh("qemu-img create -q -f qcow2 -o refcount_bits=1 r1.qcow2 12M");
  sh("qemu-img create -q -f qcow2 -o refcount_bits=64 r64.qcow2 12M");
  sh("qemu-img create -q -f qcow2 -o compat=0.10 v2.qcow2 12M");
  for (const char* n : {"r1.qcow2", "r64.qcow2"}) {
    scribble(n);
    expect_same_as_qemu(n);
  }
  sh("qemu-io -f qcow2 -c 'write -P 0x66 0 1m' -c 'write -z 100k 8k' v2.qcow2");
  expect_same_as_qemu("v2.qcow2");
}

TEST_F(Qcow2Image, CompressedZlibAndZstdMatchQemu) {
  sh("qemu-img create -q -f raw src.raw 12M");
  scribble("src.raw", "raw");
  sh("qemu-io -f raw -c 'write -P 0x77 6m 2m' src.raw");
  sh("qemu-img convert -c -O qcow2 src.raw zlib.qcow2");
  sh("qemu-img convert -c -O qcow2 -o compression_type=zstd src.raw zstd.qcow2");
  sh("qemu-img convert -c -O qcow2 -o cluster_size=2M src.raw big.qcow2");
  sh("qemu-img convert -c -O qcow2 -o cluster_size=4k,compression_type=zstd src.raw small.qcow2");
  for (const char* n : {"zlib.qcow2", "zstd.qcow2", "big.qcow2", "small.qcow2"}) {
    expect_same_as_qemu(n);
    EXPECT_EQ(mapped_, 0u) << n;  // compressed, zero or unallocated: nothing is one plain host read
  }
}

TEST_F(Qcow2Image, ExtendedL2SubclustersMatchQemu) {
  sh("qemu-img create -q -f raw base.raw 12M");
  sh("qemu-io -f raw -c 'write -P 0x99 0 12m' base.raw");
  sh("qemu-img create -q -f qcow2 -o extended_l2=on,cluster_size=64k -b base.raw -F raw ext.qcow2");
  sh("qemu-io -f qcow2 -c 'write -P 0x12 2k 2k' -c 'write -P 0x13 70k 5k' -c 'write -z 140k 6k' "
     "-c 'write -z -u 300k 64k' -c 'write -P 0x14 1m 130k' -c 'discard 1m 4k' ext.qcow2");
  expect_same_as_qemu("ext.qcow2");
  sh("qemu-img create -q -f qcow2 -o extended_l2=on,cluster_size=2M noback.qcow2 12M");
  sh("qemu-io -f qcow2 -c 'write -P 0x21 100k 64k' -c 'write -z 0 64k' noback.qcow2");
  expect_same_as_qemu("noback.qcow2");
}

TEST_F(Qcow2Image, BackingChainWithRawBaseAndRelativePaths) {
  fs::create_directories(dir_ / "sub");
  sh("qemu-img create -q -f raw sub/base.raw 6M");  // smaller than the overlays
  sh("qemu-io -f raw -c 'write -P 0xa1 0 6m' sub/base.raw");
  sh("qemu-img create -q -f qcow2 -b base.raw -F raw sub/mid.qcow2 16M");
  sh("qemu-io -f qcow2 -c 'write -P 0xb2 1m 1m' -c 'write -z 3m 64k' sub/mid.qcow2");
  sh("qemu-img create -q -f qcow2 -b sub/mid.qcow2 -F qcow2 top.qcow2 20M");
  sh("qemu-io -f qcow2 -c 'write -P 0xc3 1536k 64k' -c 'write -P 0xc4 17m 8k' top.qcow2");
  expect_same_as_qemu("top.qcow2");

  auto d = open("top.qcow2");
  ASSERT_TRUE(d.is_ok());
  auto st = io::run_sync(*engine_, (*d)->block_status(0, 1 << 20));
  ASSERT_TRUE(st.is_ok()) << st.status().to_string();
  EXPECT_TRUE(st->data);
  EXPECT_EQ(st->depth, 2);  // the raw base
  auto z = io::run_sync(*engine_, (*d)->block_status(3 << 20, 64 << 10));
  ASSERT_TRUE(z.is_ok());
  EXPECT_TRUE(z->zero);
  EXPECT_FALSE(z->data);
  EXPECT_EQ(z->depth, 1);
  auto own = io::run_sync(*engine_, (*d)->block_status(1536 << 10, 1 << 20));
  ASSERT_TRUE(own.is_ok());
  EXPECT_TRUE(own->data);
  EXPECT_EQ(own->depth, 0);
  EXPECT_EQ(own->length, 64u << 10);
}

TEST_F(Qcow2Image, BackingLargerThanOverlay) {
  sh("qemu-img create -q -f qcow2 base.qcow2 32M");
  sh("qemu-io -f qcow2 -c 'write -P 0x5a 0 32m' base.qcow2");
  sh("qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 small.qcow2 8M");
  sh("qemu-io -f qcow2 -c 'write -P 0x5b 7m 1m' small.qcow2");
  expect_same_as_qemu("small.qcow2");
}

TEST_F(Qcow2Image, BackingLoopIsRefused) {
  sh("qemu-img create -q -f qcow2 a.qcow2 1M");
  sh("qemu-img create -q -f qcow2 -b a.qcow2 -F qcow2 b.qcow2 1M");
  sh("qemu-img rebase -u -b b.qcow2 -F qcow2 a.qcow2");
  auto d = open("b.qcow2");
  ASSERT_FALSE(d.is_ok());
  EXPECT_EQ(d.status().code(), ELOOP);
  EXPECT_NE(d.status().message().find("loop"), std::string::npos) << d.status().message();
}

TEST_F(Qcow2Image, RawBackingIsNeverProbedAsQcow2) {
  // The raw base's guest wrote a qcow2 header into it; the overlay recorded "raw".
  sh("qemu-img create -q -f qcow2 inner.qcow2 1M");
  sh("qemu-img create -q -f raw base.raw 4M");
  sh("dd if=inner.qcow2 of=base.raw conv=notrunc status=none");
  sh("qemu-img create -q -f qcow2 -b base.raw -F raw top.qcow2 4M");
  expect_same_as_qemu("top.qcow2");
}

TEST_F(Qcow2Image, ExternalDataFilesMatchQemu) {
  sh("qemu-img create -q -f qcow2 -o data_file=ext.data ext.qcow2 12M");
  scribble("ext.qcow2");
  expect_same_as_qemu("ext.qcow2");
  sh("qemu-img create -q -f qcow2 -o data_file=raw.data,data_file_raw=on raw.qcow2 12M");
  sh("qemu-io -f qcow2 -c 'write -P 0x31 0 300k' -c 'write -P 0x32 5m 1m' -c 'write -z 100k 64k' raw.qcow2");
  expect_same_as_qemu("raw.qcow2");
  auto d = open("ext.qcow2");
  ASSERT_TRUE(d.is_ok());
  EXPECT_GT((*d)->allocated_bytes(), fs::file_size(path("ext.qcow2")) / 2);
}

TEST_F(Qcow2Image, PreallocatedImagesMatchQemu) {
  sh("qemu-img create -q -f qcow2 -o preallocation=metadata meta.qcow2 12M");
  sh("qemu-img create -q -f qcow2 -o preallocation=falloc falloc.qcow2 12M");
  for (const char* n : {"meta.qcow2", "falloc.qcow2"}) {
    scribble(n);
    expect_same_as_qemu(n);
  }
}

TEST_F(Qcow2Image, ZeroClustersNeedNoHostData) {
  sh("qemu-img create -q -f qcow2 z.qcow2 4M");
  sh("qemu-io -f qcow2 -c 'write -P 0x01 0 4m' -c 'write -z 1m 1m' -c 'write -z -u 2m 1m' z.qcow2");
  expect_same_as_qemu("z.qcow2");
  auto d = open("z.qcow2");
  ASSERT_TRUE(d.is_ok());
  auto st = io::run_sync(*engine_, (*d)->block_status(1 << 20, 3 << 20));
  ASSERT_TRUE(st.is_ok());
  EXPECT_TRUE(st->zero);
  EXPECT_FALSE(st->data);
  // ZERO_ALLOC keeps its host clusters (qemu-img map shows their offset), so
  // it is a run of its own before the ZERO_PLAIN one.
  EXPECT_EQ(st->length, 1u << 20);
  EXPECT_NE(st->file, nullptr);
  auto plain = io::run_sync(*engine_, (*d)->block_status(2 << 20, 2 << 20));
  ASSERT_TRUE(plain.is_ok());
  EXPECT_TRUE(plain->zero);
  EXPECT_FALSE(plain->data);
  EXPECT_TRUE(plain->present);
  EXPECT_EQ(plain->file, nullptr);
  EXPECT_EQ(plain->length, 1u << 20);
}

TEST_F(Qcow2Image, SnapshotsMatchQemuConvert) {
  sh("qemu-img create -q -f qcow2 s.qcow2 8M");
  sh("qemu-io -f qcow2 -c 'write -P 0x61 0 2m' s.qcow2");
  sh("qemu-img snapshot -c first s.qcow2");
  sh("qemu-io -f qcow2 -c 'write -P 0x62 1m 2m' -c 'write -z 0 64k' s.qcow2");
  sh("qemu-img snapshot -c second s.qcow2");
  sh("qemu-io -f qcow2 -c 'write -P 0x63 4m 1m' s.qcow2");
  sh("qemu-img convert -O raw -l snapshot.name=first s.qcow2 first.ref");
  sh("qemu-img convert -O raw -l snapshot.name=second s.qcow2 second.ref");
  expect_same_as_qemu("s.qcow2");
  auto d = open("s.qcow2");
  ASSERT_TRUE(d.is_ok());
  auto list = (*d)->snapshots();
  ASSERT_EQ(list.size(), 2u);
  EXPECT_EQ(list[0].name, "first");
  EXPECT_EQ(list[1].name, "second");
  for (const char* name : {"first", "second"}) {
    auto snap = io::run_sync(*engine_, (*d)->open_snapshot(name));
    ASSERT_TRUE(snap.is_ok()) << snap.status().to_string();
    auto got = read_all(**snap, 65536);
    ASSERT_TRUE(got.is_ok());
    EXPECT_TRUE(*got == slurp(path(std::string(name) + ".ref"))) << name;
  }
  auto missing = io::run_sync(*engine_, (*d)->open_snapshot("third"));
  EXPECT_EQ(missing.status().code(), ENOENT);
  ImageOptions opts;
  opts.snapshot = "first";
  auto direct = open("s.qcow2", opts);
  ASSERT_TRUE(direct.is_ok()) << direct.status().to_string();
  auto got = read_all(**direct, 1 << 20);
  ASSERT_TRUE(got.is_ok());
  EXPECT_TRUE(*got == slurp(path("first.ref")));
}

TEST_F(Qcow2Image, TinyL2CacheUnderConcurrentReaders) {
  sh("qemu-img create -q -f qcow2 -o cluster_size=4k t.qcow2 64M");
  sh("for i in $(seq 0 40); do qemu-io -f qcow2 -c \"write -P $i $((i*1500))k 7k\" t.qcow2; done");
  ImageOptions opts;
  opts.table_cache_size = 8192;  // two slices
  expect_same_as_qemu("t.qcow2", opts);
}

TEST_F(Qcow2Image, WritableOpenWorksAndRefusesCorruptImages) {
  sh("qemu-img create -q -f qcow2 w.qcow2 1M");
  ImageOptions opts;
  opts.file.writable = true;
  {
    auto d = open("w.qcow2", opts);
    ASSERT_TRUE(d.is_ok()) << d.status().to_string();
    EXPECT_FALSE((*d)->read_only());
    ASSERT_TRUE(io::run_sync(*engine_, (*d)->close()));
  }
  auto ro = open("w.qcow2");
  ASSERT_TRUE(ro.is_ok());
  std::byte b[512] = {};
  EXPECT_EQ(io::run_sync(*engine_, (*ro)->write(0, b)).code(), EROFS);
  ro = Status::error(EIO, "closed");
  // Set the corrupt bit (incompatible feature bit 1, byte 79).
  sh("printf '\\002' | dd of=w.qcow2 bs=1 seek=79 conv=notrunc status=none");
  auto c = open("w.qcow2", opts);
  ASSERT_FALSE(c.is_ok());
  EXPECT_EQ(c.status().code(), EROFS);
  EXPECT_NE(c.status().message().find("corrupt"), std::string::npos) << c.status().message();
  EXPECT_TRUE(open("w.qcow2").is_ok()) << "still readable";
}

// A mapped read is given only from metadata in memory and only for plain
// data of the image itself, and names the host bytes block_status names.
TEST_F(Qcow2Image, AMappedReadIsGivenOnlyForCachedPlainData) {
  sh("qemu-img create -q -f qcow2 base.qcow2 4M");
  sh("qemu-io -f qcow2 -c 'write -P 0x61 3m 1m' base.qcow2");
  sh("qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 m.qcow2 4M");
  sh("qemu-io -f qcow2 -c 'write -P 0x62 0 1m' -c 'write -z 1m 64k' m.qcow2");
  auto d = open("m.qcow2");
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  EXPECT_FALSE((*d)->map_read(0, 4096).has_value());  // its L2 slice is not loaded yet
  std::vector<std::byte> buf(4096);
  ASSERT_TRUE(io::run_sync(*engine_, (*d)->read(0, buf)));
  auto run = (*d)->map_read(8192, 4096);
  ASSERT_TRUE(run.has_value());
  auto st = io::run_sync(*engine_, (*d)->block_status(8192, 4096));
  ASSERT_TRUE(st.is_ok());
  EXPECT_EQ(run->file, st->file);
  EXPECT_EQ(run->host_offset, st->host_offset);
  run.reset();
  EXPECT_TRUE((*d)->map_read(0, 1 << 20).has_value());        // qemu-io's 1 MiB write: one host run
  EXPECT_FALSE((*d)->map_read(1 << 20, 4096).has_value());    // zero cluster
  EXPECT_FALSE((*d)->map_read((1 << 20) - 4096, 8192).has_value());  // data, then zeros
  EXPECT_FALSE((*d)->map_read(3 << 20, 4096).has_value());    // the backing file's
}

// On a writable image a mapped read holds its clusters shared, as read()
// does: a discard (which changes their mapping) waits until the run is
// dropped.
TEST_F(Qcow2Image, AMappedReadHoldsItsClustersAgainstMappingChanges) {
  sh("qemu-img create -q -f qcow2 w.qcow2 4M");
  sh("qemu-io -f qcow2 -c 'write -P 0x5a 0 4m' w.qcow2");
  ImageOptions opts;
  opts.file.writable = true;
  auto d = open("w.qcow2", opts);
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  BlockDriver& drv = **d;
  std::vector<std::byte> buf(4096);
  ASSERT_TRUE(io::run_sync(*engine_, drv.read(0, buf)));
  io::ScopedEngine scope(engine_.get());
  auto settle = [&] {
    for (int i = 0; i < 50; ++i) engine_->run_once(0);
  };
  auto run = drv.map_read(65536, 4096);
  ASSERT_TRUE(run.has_value());
  bool discarded = false;
  Status discard_st;
  auto discard = [](BlockDriver& dr, Status* st, bool* done) -> Task<void> {
    *st = co_await dr.discard(65536, 65536);
    *done = true;
  };
  spawn(discard(drv, &discard_st, &discarded));
  settle();
  EXPECT_FALSE(discarded);  // waits for the run's shared hold
  EXPECT_TRUE(drv.map_read(0, 4096).has_value());  // other clusters still map
  run.reset();
  for (int i = 0; i < 2000 && !discarded; ++i) engine_->run_once(1);
  ASSERT_TRUE(discarded);
  EXPECT_TRUE(discard_st) << discard_st.to_string();
  EXPECT_FALSE(drv.map_read(65536, 4096).has_value());  // discarded: no longer data
  ASSERT_TRUE(io::run_sync(*engine_, drv.close()));
}

// Finds the host offset of the L2 table covering guest offset 0.
uint64_t l2_table_offset(const Bytes& img) {
  uint64_t l1 = load_be64(img.data() + 40);
  return load_be64(img.data() + l1) & qcow2::kL1OffsetMask;
}

TEST_F(Qcow2Image, CorruptL2EntryFailsOnlyTheAffectedRead) {
  sh("qemu-img create -q -f qcow2 c.qcow2 4M");
  sh("qemu-io -f qcow2 -c 'write -P 0x42 0 256k' c.qcow2");
  Bytes img = slurp(path("c.qcow2"));
  uint64_t l2 = l2_table_offset(img);
  // Cluster 1 now points far beyond the end of the file.
  {
    std::fstream f(path("c.qcow2"), std::ios::in | std::ios::out | std::ios::binary);
    std::byte e[8];
    store_be64(e, qcow2::kOflagCopied | (uint64_t{1} << 40));
    f.seekp(static_cast<std::streamoff>(l2 + 8));
    f.write(reinterpret_cast<const char*>(e), 8);
  }
  auto d = open("c.qcow2");
  ASSERT_TRUE(d.is_ok());
  Bytes buf(65536);
  EXPECT_TRUE(io::run_sync(*engine_, (*d)->read(0, buf)).is_ok());
  EXPECT_EQ(buf[100], std::byte{0x42});
  Status bad = io::run_sync(*engine_, (*d)->read(65536, buf));
  EXPECT_EQ(bad.code(), EIO);
  EXPECT_NE(bad.message().find("0x10000"), std::string::npos) << bad.message();  // names the guest offset
  EXPECT_TRUE(io::run_sync(*engine_, (*d)->read(131072, buf)).is_ok());
}

TEST_F(Qcow2Image, CorruptCompressedClusterIsEio) {
  sh("qemu-img create -q -f raw src.raw 1M");
  sh("qemu-io -f raw -c 'write -P 0x42 0 1m' src.raw");
  sh("qemu-img convert -c -O qcow2 src.raw c.qcow2");
  Bytes img = slurp(path("c.qcow2"));
  uint64_t l2 = l2_table_offset(img);
  uint64_t entry = load_be64(img.data() + l2);
  ASSERT_TRUE(entry & qcow2::kOflagCompressed);
  uint64_t host = entry & qcow2::compressed_offset_mask(16);
  {
    std::fstream f(path("c.qcow2"), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(host));
    f.write("garbage garbage garbage", 23);
  }
  auto d = open("c.qcow2");
  ASSERT_TRUE(d.is_ok());
  Bytes buf(4096);
  EXPECT_EQ(io::run_sync(*engine_, (*d)->read(0, buf)).code(), EIO);
  EXPECT_TRUE(io::run_sync(*engine_, (*d)->read(65536, buf)).is_ok());
  EXPECT_EQ(buf[0], std::byte{0x42});
}

TEST_F(Qcow2Image, OpeningReadOnlyNeverWrites) {
  sh("qemu-img create -q -f qcow2 base.qcow2 4M");
  sh("qemu-io -f qcow2 -c 'write -P 0x42 0 1m' base.qcow2");
  sh("qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 top.qcow2 4M");
  Bytes top = slurp(path("top.qcow2")), base = slurp(path("base.qcow2"));
  {
    auto d = open("top.qcow2");
    ASSERT_TRUE(d.is_ok());
    ASSERT_TRUE(read_all(**d, 1 << 20).is_ok());
    EXPECT_TRUE(io::run_sync(*engine_, (*d)->close()).is_ok());
  }
  EXPECT_TRUE(slurp(path("top.qcow2")) == top);
  EXPECT_TRUE(slurp(path("base.qcow2")) == base);
}

}  // namespace
}  // namespace qcowfs::image
