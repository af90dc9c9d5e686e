// Refcount table arithmetic (entries: qcow2_refcount_entry_test.cc), overflow/underflow refusal,
// write-back into images qemu-img then checks, and refcount table growth.
#include <gtest/gtest.h>

#include <vector>

#include "image/endian.h"
#include "io/align.h"
#include "image/qcow2/alloc.h"
#include "image/qcow2/metadata.h"
#include "image/qcow2/refcount.h"
#include "unit/qcow2/qcow2_write_test_util.h"

namespace qcowfs::image::qcow2 {
namespace {

using testing::TempImage;

// Loads the refcount structures of an image made by qemu-img.
struct Loaded {
  std::unique_ptr<io::HostFile> file;
  std::unique_ptr<RefcountTable> rt;
  std::unique_ptr<ClusterAllocator> alloc;
};

Task<Result<Loaded>> load(std::string path) {
  Loaded l;
  l.file = testing::open_rw(path);
  if (!l.file) co_return Status::error(EIO, "open failed");
  std::byte hdr[104];
  auto n = co_await l.file->read(0, std::span<std::byte>(hdr, sizeof hdr));
  if (!n) co_return n.status();
  uint32_t bits = load_be32(hdr + 20);
  uint32_t order = load_be32(hdr + 4) >= 3 ? load_be32(hdr + 96) : 4;
  auto rt = co_await RefcountTable::load(*l.file, bits, order, load_be64(hdr + 48), load_be32(hdr + 56), 8);
  if (!rt) co_return rt.status();
  l.rt = std::move(*rt);
  auto used = co_await l.rt->end_of_used();
  if (!used) co_return used.status();
  l.alloc = std::make_unique<ClusterAllocator>(*l.rt, std::max(*used, div_round_up(l.file->size(), uint64_t{1} << bits)));
  co_return l;
}

// Writes the dirty refcount blocks and reftable entries in writeback order.
Task<Status> write_back(Loaded& l) {
  MetadataTracker t;
  WritebackBatch b = t.take(*l.rt, {}, 0);
  QCOWFS_CO_TRY(co_await write_batch(*l.file, *l.file, b));
  TableCache unused(*l.file, 4096, 8192);
  t.written(b, *l.rt, unused);
  co_return Status::ok();
}

Task<Result<uint64_t>> allocate(Loaded& l, uint64_t n) {
  for (;;) {
    auto r = co_await l.alloc->allocate(n);
    if (r || r.status().code() != EAGAIN) co_return r;
    QCOWFS_CO_TRY(co_await l.alloc->grow_table());
  }
}

class Qcow2RefcountWidth : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override { engine_ = std::move(*io::make_engine(io::EngineKind::threads)); }
  template <typename T>
  T run(Task<T> t) { return io::run_sync(*engine_, std::move(t)); }
  std::unique_ptr<io::Engine> engine_;
};

TEST_P(Qcow2RefcountWidth, ArithmeticOverflowAndWriteBackAsQemuSeesIt) {
  int bits = GetParam();
  TempImage img("rc", fmt::format("cluster_size=4096,refcount_bits={}", bits), "16M");
  ASSERT_TRUE(img.error().empty()) << img.error();
  auto l = run(load(img.path()));
  ASSERT_TRUE(l) << l.status().to_string();
  RefcountTable& rt = *l->rt;
  EXPECT_EQ(*run(rt.get(0)), 1u);  // the header cluster
  const uint64_t maxv = max_refcount(rt.refcount_order());

  auto first = run(allocate(*l, 5));
  ASSERT_TRUE(first) << first.status().to_string();
  for (uint64_t c = *first; c < *first + 5; ++c) EXPECT_EQ(*run(rt.get(c)), 1u);
  // Give the clusters bytes in the file (qemu-img only checks clusters inside it).
  std::vector<std::byte> zeros(5 * 4096);
  ASSERT_TRUE(run(l->file->write(*first * 4096, zeros)));
  // Raise one cluster to the maximum, then one more must fail and change nothing.
  auto shift = [&](int64_t sign) {
    for (uint64_t left = maxv - 1; left > 0;) {
      uint64_t step = std::min<uint64_t>(left, INT64_MAX);
      ASSERT_TRUE(run(rt.add(*first, 1, sign * static_cast<int64_t>(step))));
      left -= step;
    }
  };
  shift(+1);
  EXPECT_EQ(*run(rt.get(*first)), maxv);
  Status over = run(rt.add(*first, 2, +1));
  EXPECT_EQ(over.code(), EIO);
  EXPECT_EQ(*run(rt.get(*first)), maxv);
  EXPECT_EQ(*run(rt.get(*first + 1)), 1u);  // the failed range update left its neighbour alone
  shift(-1);
  EXPECT_EQ(*run(rt.get(*first)), 1u);
  EXPECT_EQ(run(rt.add(*first + 1, 1, -2)).code(), EIO);
  EXPECT_EQ(*run(rt.get(*first + 1)), 1u);

  // Three of the five stay allocated and unreferenced: qemu-img must see
  // exactly three leaked clusters, so the on-disk encoding is right.
  ASSERT_TRUE(run(l->alloc->release(*first, 2, nullptr)));
  ASSERT_TRUE(run(write_back(*l)));
  auto check = testing::qemu_img_check(img.path());
  EXPECT_EQ(check.status, 3) << check.output;
  EXPECT_NE(check.output.find("3 leaked clusters"), std::string::npos) << check.output;
  ASSERT_TRUE(run(l->alloc->release(*first + 2, 3, nullptr)));
  ASSERT_TRUE(run(write_back(*l)));
  check = testing::qemu_img_check(img.path());
  EXPECT_EQ(check.status, 0) << check.output;
}

INSTANTIATE_TEST_SUITE_P(AllWidths, Qcow2RefcountWidth, ::testing::Values(1, 2, 4, 8, 16, 32, 64));

class Qcow2RefcountTable : public Qcow2RefcountWidth {};

TEST_F(Qcow2RefcountTable, GrowsWhenAllocationsPassWhatItCovers) {
  // 512-byte clusters, 16-bit refcounts: a block covers 256 clusters and a
  // one-cluster table 64 blocks (16384 clusters, 8 MiB).
  TempImage img("grow", "cluster_size=512", "64M");
  ASSERT_TRUE(img.error().empty()) << img.error();
  auto l = run(load(img.path()));
  ASSERT_TRUE(l) << l.status().to_string();
  const uint64_t old_offset = l->rt->table_offset();
  const uint64_t old_entries = l->rt->table_entries();
  std::vector<std::pair<uint64_t, uint64_t>> runs;
  uint64_t total = 0;
  const uint64_t target = 3 * l->rt->covered_clusters();
  while (total < target) {
    auto r = run(allocate(*l, 1000));
    ASSERT_TRUE(r) << r.status().to_string();
    runs.emplace_back(*r, 1000);
    total += 1000;
  }
  EXPECT_GT(l->rt->table_entries(), old_entries);
  EXPECT_NE(l->rt->table_offset(), old_offset);
  // The header names the new table.
  std::byte hdr[12];
  ASSERT_TRUE(run(l->file->read(48, std::span<std::byte>(hdr, sizeof hdr))));
  EXPECT_EQ(load_be64(hdr), l->rt->table_offset());
  EXPECT_EQ(load_be32(hdr + 8), l->rt->table_clusters());
  // Runs never overlap each other or the refcount structures.
  for (auto [s, n] : runs)
    for (uint64_t c = s; c < s + n; ++c) ASSERT_EQ(*run(l->rt->get(c)), 1u);
  for (auto [s, n] : runs) ASSERT_TRUE(run(l->alloc->release(s, n, nullptr)));
  ASSERT_TRUE(run(write_back(*l)));
  auto check = testing::qemu_img_check(img.path());
  EXPECT_EQ(check.status, 0) << check.output;
  // The old table's clusters were freed and are reused first.
  auto again = run(allocate(*l, 1));
  ASSERT_TRUE(again);
  EXPECT_EQ(*again, old_offset / 512);
}

}  // namespace
}  // namespace qcowfs::image::qcow2
