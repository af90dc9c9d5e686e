// TableCache over MemFile: one host read per slice, shared concurrent loads,
// LRU eviction that spares pinned and dirty slices, failed loads retried.
#include <gtest/gtest.h>

#include "image/endian.h"
#include "image/extent/table_cache.h"
#include "io/engine.h"
#include "io/mem_file.h"
#include "io/run_sync.h"
#include "io/sync.h"
#include "unit/qcow2/qcow2_gated_file.h"

namespace qcowfs::image {
namespace {

constexpr size_t kSlice = 4096;
using qcow2::testing::GatedFile;

class TableCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto e = io::make_engine(io::EngineKind::automatic);
    ASSERT_TRUE(e.is_ok());
    engine_ = std::move(*e);
    // 16 slices; entry 0 of slice i holds the value i + 1000.
    std::vector<std::byte> content(16 * kSlice);
    for (size_t i = 0; i < 16; ++i) store_be64(content.data() + i * kSlice, i + 1000);
    file_ = std::make_unique<io::MemFile>(io::MemFileOptions{}, std::move(content));
  }
  Result<TableCache::Ref> get(TableCache& c, uint64_t off) { return io::run_sync(*engine_, c.get(off)); }
  uint64_t reads() const { return file_->counters().reads; }

  std::unique_ptr<io::Engine> engine_;
  std::unique_ptr<io::MemFile> file_;
};

TEST_F(TableCacheTest, LoadsEachSliceOnce) {
  TableCache c(*file_, kSlice, 8 * kSlice);
  auto a = get(c, 3 * kSlice);
  ASSERT_TRUE(a.is_ok());
  EXPECT_EQ(a->be64(0), 1003u);
  a->reset();
  auto again = get(c, 3 * kSlice);
  ASSERT_TRUE(again.is_ok());
  EXPECT_EQ(again->be64(0), 1003u);
  EXPECT_EQ(reads(), 1u);
  EXPECT_EQ(c.host_reads(), 1u);
}

TEST_F(TableCacheTest, TryGetHitsOnlyLoadedSlices) {
  TableCache c(*file_, kSlice, 8 * kSlice);
  EXPECT_FALSE(c.try_get(2 * kSlice).is_ok());
  EXPECT_EQ(reads(), 0u);  // a miss never reads
  ASSERT_TRUE(get(c, 2 * kSlice).is_ok());
  auto hit = c.try_get(2 * kSlice);
  ASSERT_TRUE(hit.is_ok());
  EXPECT_EQ(hit->be64(0), 1002u);
  EXPECT_EQ(reads(), 1u);
}

TEST_F(TableCacheTest, ConcurrentLoadsOfOneSliceShareOneRead) {
  GatedFile gated(*file_);
  TableCache c(gated, kSlice, 8 * kSlice);
  int done = 0;
  uint64_t seen[3] = {};
  io::run_sync(*engine_, [&]() -> Task<void> {
    for (int i = 0; i < 3; ++i)
      spawn_then(c.get(5 * kSlice), [&, i](Result<TableCache::Ref> r) {
        if (r.is_ok()) seen[i] = r->be64(0);
        ++done;
      });
    EXPECT_EQ(done, 0);  // all three wait for the one load
    gated.open();
    co_return;
  }());
  while (done < 3) engine_->run_once(100);
  EXPECT_EQ(reads(), 1u);
  for (uint64_t v : seen) EXPECT_EQ(v, 1005u);
}

TEST_F(TableCacheTest, EvictsLeastRecentlyUsedSlice) {
  TableCache c(*file_, kSlice, 2 * kSlice);
  EXPECT_EQ(c.capacity_slices(), 2u);
  ASSERT_TRUE(get(c, 0).is_ok());
  ASSERT_TRUE(get(c, kSlice).is_ok());
  ASSERT_TRUE(get(c, 0).is_ok());          // 0 most recent
  ASSERT_TRUE(get(c, 2 * kSlice).is_ok()); // evicts slice 1
  EXPECT_EQ(c.cached_slices(), 2u);
  EXPECT_EQ(reads(), 3u);
  ASSERT_TRUE(get(c, 0).is_ok());
  EXPECT_EQ(reads(), 3u);
  ASSERT_TRUE(get(c, kSlice).is_ok());
  EXPECT_EQ(reads(), 4u);
}

TEST_F(TableCacheTest, PinnedSlicesAreNeverEvicted) {
  TableCache c(*file_, kSlice, 2 * kSlice);
  auto pinned = get(c, 7 * kSlice);
  ASSERT_TRUE(pinned.is_ok());
  for (uint64_t i = 0; i < 5; ++i) ASSERT_TRUE(get(c, i * kSlice).is_ok());
  EXPECT_EQ(pinned->be64(0), 1007u);
  uint64_t before = reads();
  ASSERT_TRUE(get(c, 7 * kSlice).is_ok());
  EXPECT_EQ(reads(), before);  // still cached
}

TEST_F(TableCacheTest, AllPinnedCacheGrowsInsteadOfBlocking) {
  TableCache c(*file_, kSlice, 2 * kSlice);
  std::vector<TableCache::Ref> refs;
  for (uint64_t i = 0; i < 4; ++i) {
    auto r = get(c, i * kSlice);
    ASSERT_TRUE(r.is_ok());
    refs.push_back(std::move(*r));
  }
  EXPECT_EQ(c.cached_slices(), 4u);
  refs.clear();
  ASSERT_TRUE(get(c, 9 * kSlice).is_ok());
  EXPECT_LE(c.cached_slices(), 2u);
}

TEST_F(TableCacheTest, DirtySlicesStayUntilWrittenBack) {
  TableCache c(*file_, kSlice, 2 * kSlice);
  auto d = get(c, 4 * kSlice);
  ASSERT_TRUE(d.is_ok());
  store_be64(d->mutable_bytes().data(), 42);
  c.mark_dirty(*d);
  d->reset();
  for (uint64_t i = 0; i < 4; ++i) ASSERT_TRUE(get(c, i * kSlice).is_ok());
  auto again = get(c, 4 * kSlice);
  ASSERT_TRUE(again.is_ok());
  EXPECT_EQ(again->be64(0), 42u);  // the modified copy, not a reload
  c.clear_dirty(*again);
  again->reset();
  for (uint64_t i = 0; i < 4; ++i) ASSERT_TRUE(get(c, i * kSlice).is_ok());
  auto reloaded = get(c, 4 * kSlice);
  ASSERT_TRUE(reloaded.is_ok());
  EXPECT_EQ(reloaded->be64(0), 1004u);
}

TEST_F(TableCacheTest, FailedLoadIsReportedAndRetried) {
  TableCache c(*file_, kSlice, 4 * kSlice);
  file_->fail_nth(io::OpKind::read, 1, EIO);
  auto bad = get(c, 2 * kSlice);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_EQ(bad.status().code(), EIO);
  EXPECT_EQ(c.cached_slices(), 0u);
  auto good = get(c, 2 * kSlice);
  ASSERT_TRUE(good.is_ok()) << good.status().to_string();
  EXPECT_EQ(good->be64(0), 1002u);
}

TEST_F(TableCacheTest, SliceTruncatedByEndOfFileIsEio) {
  TableCache c(*file_, kSlice, 4 * kSlice);
  file_->short_once(io::OpKind::read, 100);
  auto r = get(c, 0);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), EIO);
}

TEST_F(TableCacheTest, DefaultSizeCoversDiskUpToCap) {
  if (TableCache::tiny()) {
    EXPECT_EQ(TableCache::default_size(1ull << 40, kSlice), 2 * kSlice);
    return;
  }
  EXPECT_EQ(TableCache::default_size(1 << 20, kSlice), 1u << 20);
  EXPECT_EQ(TableCache::default_size(1ull << 40, kSlice), TableCache::kDefaultMaxBytes);
  EXPECT_EQ(TableCache::default_size(100, kSlice), 8 * kSlice);
}

}  // namespace
}  // namespace qcowfs::image
