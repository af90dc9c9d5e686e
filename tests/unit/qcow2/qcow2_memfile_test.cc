// The qcow2 driver over an in-memory host file: how many host reads a request
// issues (one per host-contiguous run, all at once), what needs no host I/O at
// all (zero clusters, cached compressed clusters) and host errors reaching
// the caller.
#include <gtest/gtest.h>

#include <random>

#include "image/endian.h"
#include "image/qcow2/qcow2.h"
#include "io/engine.h"
#include "io/mem_file.h"
#include "io/run_sync.h"
#include "unit/qcow2/qcow2_gated_file.h"
#include "unit/qcow2/qcow2_test_util.h"

namespace qcowfs::image {
namespace {

using Bytes = std::vector<std::byte>;
constexpr uint64_t kCs = 65536;

class Qcow2MemFile : public qcow2::testing::QemuImageTest {
 protected:
  Qcow2MemFile() : QemuImageTest("qcowfs_qcow2_memfile_test", io::EngineKind::automatic) {}

  // Builds i.qcow2 with shell commands and opens it read-only from a MemFile
  // behind a GatedFile.
  void make(const std::string& commands) {
    mem_ = build_image(commands);
    ASSERT_FALSE(HasFailure());
    auto gated = std::make_unique<qcow2::testing::GatedFile>(*mem_, image_path());
    gated_ = gated.get();
    gated_->open();
    auto d = io::run_sync(*engine_, open_qcow2(std::move(gated), image_path(), {}));
    ASSERT_TRUE(d.is_ok()) << d.status().to_string();
    driver_ = std::move(*d);
  }

  // Opens `content` as a read-only image from memory (no gate).
  Result<std::unique_ptr<BlockDriver>> open_bytes(Bytes content) {
    io::MemFileOptions o;
    o.writable = false;
    o.path = image_path();
    auto f = std::make_unique<io::MemFile>(o, std::move(content));
    return io::run_sync(*engine_, open_qcow2(std::move(f), o.path, {}));
  }

  Status read(uint64_t off, Bytes& buf) { return io::run_sync(*engine_, driver_->read(off, buf)); }
  uint64_t host_reads() const { return mem_->counters().reads; }

  std::unique_ptr<io::MemFile> mem_;
  qcow2::testing::GatedFile* gated_ = nullptr;
};

TEST_F(Qcow2MemFile, HostContiguousClustersBecomeOneHostRead) {
  make("qemu-img create -q -f qcow2 i.qcow2 8M && qemu-io -f qcow2 -c 'write -P 0x3c 0 8m' i.qcow2");
  Bytes warm(4096);
  ASSERT_TRUE(read(0, warm).is_ok());  // loads the L2 slice
  uint64_t before = host_reads();
  Bytes buf(2 << 20);
  ASSERT_TRUE(read(1 << 20, buf).is_ok());
  EXPECT_EQ(host_reads() - before, 1u);  // 32 clusters, one host read
  EXPECT_EQ(buf.front(), std::byte{0x3c});
  EXPECT_EQ(buf.back(), std::byte{0x3c});
}

TEST_F(Qcow2MemFile, FragmentedRequestIssuesAllHostReadsAtOnce) {
  // Written back to front: guest clusters 0..3 live at descending host offsets.
  make("qemu-img create -q -f qcow2 i.qcow2 1M && qemu-io -f qcow2 -c 'write -P 4 192k 64k' "
       "-c 'write -P 3 128k 64k' -c 'write -P 2 64k 64k' -c 'write -P 1 0 64k' i.qcow2");
  Bytes warm(512);
  ASSERT_TRUE(read(0, warm).is_ok());
  uint64_t before = host_reads();
  gated_->close();
  Bytes buf(4 * kCs);
  bool done = false;
  Status result;
  {
    io::ScopedEngine scope(engine_.get());
    spawn_then(driver_->read(0, buf), [&](Status st) {
      result = std::move(st);
      done = true;
    });
    for (int i = 0; i < 100 && gated_->in_flight() < 4; ++i) engine_->run_once(0);
    EXPECT_EQ(gated_->in_flight(), 4);  // every host read is out before any completes
    gated_->open();
    while (!done) engine_->run_once(100);
  }
  ASSERT_TRUE(result.is_ok()) << result.to_string();
  EXPECT_EQ(host_reads() - before, 4u);
  for (int c = 0; c < 4; ++c) EXPECT_EQ(buf[static_cast<size_t>(c) * kCs + 7], std::byte(c + 1)) << c;
}

TEST_F(Qcow2MemFile, ZeroAndUnallocatedClustersNeedNoHostIo) {
  make("qemu-img create -q -f qcow2 i.qcow2 4M && qemu-io -f qcow2 -c 'write -P 9 0 4m' "
       "-c 'write -z 1m 1m' -c 'write -z -u 2m 64k' i.qcow2");
  Bytes warm(512);
  ASSERT_TRUE(read(0, warm).is_ok());
  uint64_t before = host_reads();
  Bytes buf((1 << 20) + kCs, std::byte{0xee});
  ASSERT_TRUE(read(1 << 20, buf).is_ok());
  EXPECT_EQ(host_reads(), before);
  for (std::byte b : buf) ASSERT_EQ(b, std::byte{0});
}

TEST_F(Qcow2MemFile, CompressedClusterIsDecompressedOnceForManySmallReads) {
  make("qemu-img create -q -f raw s.raw 1M && qemu-io -f raw -c 'write -P 0x71 0 1m' s.raw && "
       "qemu-img convert -c -O qcow2 s.raw i.qcow2");
  Bytes buf(4096);
  ASSERT_TRUE(read(0, buf).is_ok());
  uint64_t before = host_reads();
  for (uint64_t off = 4096; off < kCs; off += 4096) {
    ASSERT_TRUE(read(off, buf).is_ok());
    EXPECT_EQ(buf[11], std::byte{0x71});
  }
  EXPECT_EQ(host_reads(), before);
}

TEST_F(Qcow2MemFile, HostReadErrorReachesTheCaller) {
  make("qemu-img create -q -f qcow2 i.qcow2 1M && qemu-io -f qcow2 -c 'write -P 5 0 1m' i.qcow2");
  Bytes buf(kCs);
  ASSERT_TRUE(read(0, buf).is_ok());
  mem_->fail_nth(io::OpKind::read, 1, EIO);
  EXPECT_EQ(read(kCs, buf).code(), EIO);
  ASSERT_TRUE(read(kCs, buf).is_ok());
  EXPECT_EQ(buf[0], std::byte{5});
}

TEST_F(Qcow2MemFile, L2LoadErrorReachesTheCallerAndIsRetried) {
  make("qemu-img create -q -f qcow2 i.qcow2 1M && qemu-io -f qcow2 -c 'write -P 6 0 1m' i.qcow2");
  mem_->fail_nth(io::OpKind::read, 1, EIO);  // the first read of a request is its L2 slice
  Bytes buf(kCs);
  EXPECT_EQ(read(0, buf).code(), EIO);
  ASSERT_TRUE(read(0, buf).is_ok());
  EXPECT_EQ(buf[0], std::byte{6});
}

TEST_F(Qcow2MemFile, OpeningReadsOnlyHeaderAndL1) {
  make("qemu-img create -q -f qcow2 -o cluster_size=4k i.qcow2 1G && "
       "qemu-io -f qcow2 -c 'write 0 1m' -c 'write 512m 1m' i.qcow2");
  // Header probe + header cluster + L1 table; no L2 or refcount scan.
  EXPECT_LE(mem_->counters().reads, 3u);
  EXPECT_EQ(mem_->counters().writes, 0u);
}

// Random words written over the metadata (header, L1, L2, refcounts) of a real
// image: opening either fails cleanly or every read returns data or EIO.
TEST_F(Qcow2MemFile, RandomMetadataDamageNeverCrashesOrHangs) {
  // Compressed, normal and zero clusters.
  make("qemu-img create -q -f raw s.raw 2M && qemu-io -f raw -c 'write -P 1 0 512k' s.raw && "
       "qemu-img convert -c -O qcow2 -o cluster_size=4k s.raw i.qcow2 && "
       "qemu-io -f qcow2 -c 'write -z 600k 64k' -c 'write -P 2 1m 100k' -c 'write -P 3 100k 8k' i.qcow2");
  Bytes pristine = mem_->content();
  std::mt19937_64 rng(12345);
  int opened = 0, eio = 0;
  for (int round = 0; round < 200; ++round) {
    Bytes img = pristine;
    uint64_t metadata_end = std::min<uint64_t>(img.size(), 8 * 4096);
    for (int k = 0; k < 4; ++k) {
      size_t at = static_cast<size_t>(rng() % (metadata_end / 8)) * 8;
      uint64_t v = rng();
      if (rng() % 2) v &= 0x00ffffffffffffffull;  // plausible offsets more often
      store_be64(img.data() + at, v);
    }
    auto d = open_bytes(std::move(img));
    if (!d.is_ok()) continue;
    ++opened;
    Bytes buf(64 * 1024);
    for (uint64_t off = 0; off < (*d)->size(); off += buf.size()) {
      size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), (*d)->size() - off));
      Bytes part(n);
      Status st = io::run_sync(*engine_, (*d)->read(off, part));
      if (!st.is_ok()) {
        EXPECT_EQ(st.code(), EIO) << st.to_string();
        ++eio;
      }
      auto bs = io::run_sync(*engine_, (*d)->block_status(off, n));
      if (bs.is_ok()) {
        EXPECT_GT(bs->length, 0u);
      }
    }
  }
  EXPECT_GT(opened, 0);  // the damage must not be refused wholesale
  EXPECT_GT(eio, 0);     // and must be noticed somewhere
}

}  // namespace
}  // namespace qcowfs::image
