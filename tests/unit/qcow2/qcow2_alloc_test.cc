// Cluster allocator: contiguous runs, appending at the end, reuse of freed
// runs (first fit from the hint), skipping holes that are too small,
// refcount blocks created on the way covering themselves, and the byte
// packing of compressed clusters (QEMU's qcow2_alloc_bytes).
#include <gtest/gtest.h>

#include "image/endian.h"
#include "io/align.h"
#include "image/qcow2/alloc.h"
#include "image/qcow2/metadata.h"
#include "image/qcow2/refcount.h"
#include "unit/qcow2/qcow2_write_test_util.h"

namespace qcowfs::image::qcow2 {
namespace {

using testing::TempImage;

class Qcow2Alloc : public ::testing::Test {
 protected:
  void open(const std::string& options, const std::string& size) {
    img_ = std::make_unique<TempImage>("alloc", options, size);
    ASSERT_TRUE(img_->error().empty()) << img_->error();
    engine_ = std::move(*io::make_engine(io::EngineKind::threads));
    file_ = testing::open_rw(img_->path());
    ASSERT_TRUE(file_);
    std::byte hdr[104];
    ASSERT_TRUE(run(file_->read(0, std::span<std::byte>(hdr, sizeof hdr))));
    bits_ = load_be32(hdr + 20);
    auto rt = run(RefcountTable::load(*file_, bits_, load_be32(hdr + 96), load_be64(hdr + 48), load_be32(hdr + 56), 8));
    ASSERT_TRUE(rt) << rt.status().to_string();
    rt_ = std::move(*rt);
    end_ = div_round_up(file_->size(), uint64_t{1} << bits_);
    alloc_ = std::make_unique<ClusterAllocator>(*rt_, end_);
  }
  template <typename T>
  T run(Task<T> t) { return io::run_sync(*engine_, std::move(t)); }
  uint64_t allocate(uint64_t n) {
    for (;;) {
      auto r = run(alloc_->allocate(n));
      if (r) return *r;
      EXPECT_EQ(r.status().code(), EAGAIN) << r.status().to_string();
      if (r.status().code() != EAGAIN) return 0;
      EXPECT_TRUE(run(alloc_->grow_table()));
    }
  }
  void release(uint64_t first, uint64_t n) { ASSERT_TRUE(run(alloc_->release(first, n, nullptr))); }
  Status write_back() {
    MetadataTracker t;
    WritebackBatch b = t.take(*rt_, {}, 0);
    Status st = run(write_batch(*file_, *file_, b));
    TableCache unused(*file_, 4096, 8192);
    t.written(b, *rt_, unused);
    return st;
  }

  std::unique_ptr<TempImage> img_;
  std::unique_ptr<io::Engine> engine_;
  std::unique_ptr<io::HostFile> file_;
  std::unique_ptr<RefcountTable> rt_;
  std::unique_ptr<ClusterAllocator> alloc_;
  uint32_t bits_ = 0;
  uint64_t end_ = 0;
};

TEST_F(Qcow2Alloc, RunsAreContiguousAndAppendAtTheEnd) {
  open("cluster_size=65536", "1G");
  uint64_t a = allocate(4);
  EXPECT_EQ(a, end_);
  uint64_t b = allocate(16);
  EXPECT_EQ(b, a + 4);
  for (uint64_t c = a; c < b + 16; ++c) EXPECT_EQ(*run(rt_->get(c)), 1u);
  EXPECT_EQ(alloc_->end_cluster(), b + 16);
}

TEST_F(Qcow2Alloc, FreedRunIsReusedAndTooSmallHolesAreSkipped) {
  open("cluster_size=65536", "1G");
  uint64_t a = allocate(10);
  release(a + 2, 3);  // hole of 3 at a+2
  release(a + 7, 1);  // hole of 1 at a+7
  uint64_t big = allocate(4);
  EXPECT_EQ(big, a + 10) << "a 4-cluster run does not fit a 3-cluster hole";
  uint64_t fit = allocate(3);
  EXPECT_EQ(fit, a + 2) << "the freed run is reused";
  uint64_t one = allocate(1);
  EXPECT_EQ(one, a + 7);
  EXPECT_EQ(allocate(1), a + 14);
}

TEST_F(Qcow2Alloc, FreeRunAtTheEndExtendsIntoUnusedSpace) {
  open("cluster_size=65536", "1G");
  uint64_t a = allocate(4);
  release(a + 2, 2);
  EXPECT_EQ(allocate(5), a + 2);
}

TEST_F(Qcow2Alloc, NewRefcountBlocksCoverThemselvesAndQemuAgrees) {
  // 512-byte clusters, 16-bit refcounts: one block per 256 clusters.
  open("cluster_size=512", "16M");
  const uint64_t per = rt_->block_entries();
  ASSERT_EQ(per, 256u);
  uint64_t blocks_before = 0;
  for (uint64_t r = 0; r < rt_->table_entries(); ++r) blocks_before += rt_->has_block(r) ? 1 : 0;
  std::vector<uint64_t> runs;
  for (int i = 0; i < 10; ++i) runs.push_back(allocate(100));
  uint64_t blocks_after = 0;
  for (uint64_t r = 0; r < rt_->table_entries(); ++r) {
    if (!rt_->has_block(r)) continue;
    ++blocks_after;
    uint64_t host_cluster = rt_->table_entry(r) >> bits_;
    EXPECT_EQ(*run(rt_->get(host_cluster)), 1u) << "block " << r << " counts its own cluster";
    for (uint64_t s : runs) EXPECT_FALSE(host_cluster >= s && host_cluster < s + 100) << "block inside a data run";
  }
  EXPECT_GE(blocks_after, blocks_before + 3);
  for (uint64_t s : runs) release(s, 100);
  ASSERT_TRUE(write_back());
  auto check = testing::qemu_img_check(img_->path());
  EXPECT_EQ(check.status, 0) << check.output;
}

// Streams follow each other byte by byte in one cluster, each taking a
// reference; one that does not fit crosses into the next cluster when that is
// the one handed out, else starts there; a freed cluster is not packed into.
TEST_F(Qcow2Alloc, CompressedStreamsArePackedAsQemuPacksThem) {
  open("cluster_size=65536", "1G");
  const uint64_t cs = uint64_t{1} << bits_;
  auto bytes = [&](uint64_t size) {
    for (;;) {
      auto r = run(alloc_->allocate_bytes(size));
      if (r) return *r;
      EXPECT_EQ(r.status().code(), EAGAIN) << r.status().to_string();
      if (r.status().code() != EAGAIN) return ClusterAllocator::ByteRun{};
      EXPECT_TRUE(run(alloc_->grow_table()));
    }
  };
  auto refs = [&](uint64_t hc) { return *run(rt_->get(hc)); };
  const auto a = bytes(1000);
  EXPECT_EQ(a.offset, end_ * cs);
  EXPECT_EQ(a.new_cluster, end_);
  const auto b = bytes(3001);
  EXPECT_EQ(b.offset, a.offset + 1000) << "byte granular, not sector aligned";
  EXPECT_EQ(b.new_cluster, 0u);
  EXPECT_EQ(refs(end_), 2u);
  const auto c = bytes(cs - 1);  // does not fit the rest: crosses into the next cluster
  EXPECT_EQ(c.offset, b.offset + 3001);
  EXPECT_EQ(c.new_cluster, end_ + 1);
  EXPECT_EQ(refs(end_), 3u);
  EXPECT_EQ(refs(end_ + 1), 1u);
  EXPECT_EQ(alloc_->free_byte_offset(), c.offset + cs - 1);
  // An ordinary cluster taken in between: the next stream that does not fit
  // cannot cross, it starts at the next new cluster.
  const uint64_t plain = allocate(1);
  EXPECT_EQ(plain, end_ + 2);
  const auto d = bytes(cs - 100);
  EXPECT_EQ(d.offset, (end_ + 3) * cs);
  EXPECT_EQ(d.new_cluster, end_ + 3);
  EXPECT_EQ(refs(end_ + 1), 1u) << "the old cluster's tail stays unused";
  // Exactly filling a cluster leaves no partly used one.
  const auto e = bytes(100);
  EXPECT_EQ(e.offset, d.offset + cs - 100);
  EXPECT_EQ(alloc_->free_byte_offset(), 0u);
  // The partly used cluster freed: the next stream starts elsewhere.
  const auto f = bytes(10);
  ASSERT_EQ(f.new_cluster, end_ + 4);
  release(end_ + 4, 1);
  EXPECT_EQ(alloc_->free_byte_offset(), 0u);
  const auto g = bytes(10);
  EXPECT_EQ(g.offset, g.new_cluster * cs);
}

// 1-bit refcounts: a partly used cluster at the maximum takes no more streams.
TEST_F(Qcow2Alloc, CompressedStreamsLeaveAClusterAtTheRefcountMaximum) {
  open("cluster_size=65536,refcount_bits=1", "1G");
  const uint64_t cs = uint64_t{1} << bits_;
  auto a = run(alloc_->allocate_bytes(1000));
  ASSERT_TRUE(a) << a.status().to_string();
  auto b = run(alloc_->allocate_bytes(1000));
  ASSERT_TRUE(b) << b.status().to_string();
  EXPECT_EQ(b->offset, b->new_cluster * cs);
  EXPECT_NE(b->new_cluster, a->new_cluster);
}

}  // namespace
}  // namespace qcowfs::image::qcow2
