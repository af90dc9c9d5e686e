// BlockCache tests (io/remote/block_cache.h): reads assembled from blocks,
// hits without refetching, the LRU bound, readahead that grows on sequential
// reads and stops on random ones, and failed fetches that are not kept.
// The fetch function here completes at once from an in-memory pattern.
#include <algorithm>
#include <set>
#include <vector>

#include <gtest/gtest.h>

#include "io/remote/block_cache.h"
#include "io_test_util.h"

namespace qcowfs::io {
namespace {

using testing::pattern;
using testing::run_now;

constexpr uint64_t kBlock = 64 * 1024;

struct FakeRemote {
  std::vector<std::byte> data;
  std::vector<uint64_t> fetched;  // offsets, in order
  std::set<uint64_t> fail_once;   // offsets whose next fetch fails

  BlockCache::Fetch fetch() {
    return [this](uint64_t off, std::span<std::byte> dst, std::function<void(Status)> done) {
      fetched.push_back(off);
      if (fail_once.erase(off)) return done(Status::error(EIO, "injected"));
      std::copy_n(data.begin() + static_cast<ptrdiff_t>(off), dst.size(), dst.begin());
      done(Status::ok());
    };
  }
};

std::vector<std::byte> read(BlockCache& c, uint64_t off, size_t n) {
  std::vector<std::byte> out(n);
  auto r = run_now(c.read(off, out));
  EXPECT_TRUE(r) << r.status().to_string();
  out.resize(r ? *r : 0);
  return out;
}

TEST(BlockCache, ReadsSpanBlocksAndHitsDoNotRefetch) {
  FakeRemote remote{pattern(10 * kBlock + 100, 1), {}, {}};
  BlockCache c(remote.data.size(), {kBlock, 64 * kBlock, 0}, remote.fetch());
  auto got = read(c, kBlock - 10, 2 * kBlock);
  EXPECT_TRUE(std::equal(got.begin(), got.end(), remote.data.begin() + kBlock - 10));
  EXPECT_EQ(remote.fetched, (std::vector<uint64_t>{0, kBlock, 2 * kBlock}));
  read(c, 10, 100);
  EXPECT_EQ(remote.fetched.size(), 3u);
  auto tail = read(c, 10 * kBlock, 4096);  // the short last block, and the end of the object
  ASSERT_EQ(tail.size(), 100u);
  EXPECT_TRUE(std::equal(tail.begin(), tail.end(), remote.data.begin() + 10 * kBlock));
  EXPECT_TRUE(read(c, remote.data.size(), 10).empty());
}

TEST(BlockCache, KeepsAtMostItsCapacity) {
  FakeRemote remote{pattern(16 * kBlock, 2), {}, {}};
  BlockCache c(remote.data.size(), {kBlock, 2 * kBlock, 0}, remote.fetch());
  for (uint64_t b : {uint64_t{0}, uint64_t{5}, uint64_t{9}}) read(c, b * kBlock, 1);
  read(c, 9 * kBlock, 1);  // still cached
  EXPECT_EQ(remote.fetched.size(), 3u);
  read(c, 0, 1);  // evicted (least recently used): fetched again
  EXPECT_EQ(remote.fetched.size(), 4u);
  EXPECT_EQ(remote.fetched.back(), 0u);
}

TEST(BlockCache, ReadaheadGrowsWhenSequentialAndStopsWhenRandom) {
  FakeRemote remote{pattern(64 * kBlock, 3), {}, {}};
  BlockCache c(remote.data.size(), {kBlock, 64 * kBlock, 4 * kBlock}, remote.fetch());
  read(c, 0, kBlock);  // first read: nothing known yet
  EXPECT_EQ(remote.fetched.size(), 1u);
  read(c, kBlock, kBlock);  // sequential: one block ahead
  EXPECT_EQ(remote.fetched, (std::vector<uint64_t>{0, kBlock, 2 * kBlock}));
  read(c, 2 * kBlock, kBlock);  // window doubles: blocks 3 and 4 ahead
  EXPECT_EQ(remote.fetched.size(), 5u);
  EXPECT_EQ(remote.fetched.back(), 4 * kBlock);
  const size_t before = remote.fetched.size();
  read(c, 40 * kBlock, 10);  // random: only what is read
  read(c, 20 * kBlock, 10);
  EXPECT_EQ(remote.fetched.size(), before + 2);
  EXPECT_EQ(c.stats().readahead, 3u);
}

TEST(BlockCache, AFailedFetchFailsTheReadAndIsRetriedNextTime) {
  FakeRemote remote{pattern(4 * kBlock, 4), {}, {}};
  remote.fail_once.insert(kBlock);
  BlockCache c(remote.data.size(), {kBlock, 64 * kBlock, 0}, remote.fetch());
  std::vector<std::byte> buf(2 * kBlock);
  auto r = run_now(c.read(0, buf));
  ASSERT_FALSE(r);
  EXPECT_EQ(r.status().code(), EIO);
  auto got = read(c, kBlock, kBlock);
  EXPECT_TRUE(std::equal(got.begin(), got.end(), remote.data.begin() + kBlock));
  EXPECT_EQ(c.stats().failures, 1u);
}

}  // namespace
}  // namespace qcowfs::io
