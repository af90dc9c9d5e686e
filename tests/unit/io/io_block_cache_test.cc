// BlockCache tests (io/remote/block_cache.h): reads assembled from blocks,
// hits without refetching, the LRU bound, readahead that grows on sequential
// reads and stops on random ones, and failed fetches that are not kept.
// The fetch policy: small random reads fetch only their 4 KiB granules, a
// sequential stream fetches whole blocks, adjacent ones in one request.
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
  std::vector<std::pair<uint64_t, uint64_t>> requests = {};  // (offset, bytes) of each fetch

  BlockCache::Fetch fetch() {
    return [this](uint64_t off, BlockCache::Buffers dst, std::function<void(Status)> done) {
      fetched.push_back(off);
      if (fail_once.erase(off)) return done(Status::error(EIO, "injected"));
      uint64_t at = off;
      for (std::span<std::byte> d : dst) {
        std::copy_n(data.begin() + static_cast<ptrdiff_t>(at), d.size(), d.begin());
        at += d.size();
      }
      requests.emplace_back(off, at - off);
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

using Requests = std::vector<std::pair<uint64_t, uint64_t>>;

TEST(BlockCache, SmallRandomReadsFetchOnlyTheirGranules) {
  FakeRemote remote{pattern(64 * kBlock, 6), {}, {}};
  // 64 KiB blocks; small random reads in 4 KiB granules; requests of up to 4 blocks.
  BlockCache c(remote.data.size(), {kBlock, 64 * kBlock, 16 * kBlock, 4 * kBlock, 4096}, remote.fetch());
  auto got = read(c, 40 * kBlock + 5000, 6000);  // granules 1 and 2 of block 40: one request
  EXPECT_TRUE(std::equal(got.begin(), got.end(), remote.data.begin() + 40 * kBlock + 5000));
  EXPECT_EQ(remote.requests, (Requests{{40 * kBlock + 4096, 8192}}));
  got = read(c, 40 * kBlock + 4096, 100);  // cached: no request
  EXPECT_TRUE(std::equal(got.begin(), got.end(), remote.data.begin() + 40 * kBlock + 4096));
  read(c, 20 * kBlock + 100, 10);
  EXPECT_EQ(remote.requests.back(), (std::pair<uint64_t, uint64_t>{20 * kBlock, 4096}));
  read(c, 10 * kBlock + 10, kBlock);  // a block or more: whole blocks, even when random
  EXPECT_EQ(remote.requests.back(), (std::pair<uint64_t, uint64_t>{10 * kBlock, 2 * kBlock}));
  EXPECT_EQ(c.stats().small, 3u);
  EXPECT_EQ(c.stats().readahead, 0u);  // no read was sequential
  // Reading on from a granule is sequential: whole blocks, and the window opens.
  got = read(c, 40 * kBlock + 3 * 4096, 4096);
  EXPECT_TRUE(std::equal(got.begin(), got.end(), remote.data.begin() + 40 * kBlock + 3 * 4096));
  EXPECT_EQ(remote.requests.back(), (std::pair<uint64_t, uint64_t>{41 * kBlock, kBlock}));  // read ahead
  EXPECT_EQ(remote.requests[remote.requests.size() - 2], (std::pair<uint64_t, uint64_t>{40 * kBlock, kBlock}));
}

TEST(BlockCache, SequentialStreamFetchesAdjacentBlocksInBigRequests) {
  FakeRemote remote{pattern(256 * kBlock, 8), {}, {}};
  // Requests of up to 4 blocks, readahead up to 16.
  BlockCache c(remote.data.size(), {kBlock, 256 * kBlock, 16 * kBlock, 4 * kBlock, 4096}, remote.fetch());
  for (uint64_t off = 0; off < 64 * kBlock; off += 2 * kBlock) {
    auto got = read(c, off, 2 * kBlock);
    ASSERT_TRUE(std::equal(got.begin(), got.end(), remote.data.begin() + static_cast<ptrdiff_t>(off)));
  }
  // Whole blocks, never one twice, never more than the window past the reader.
  std::set<uint64_t> blocks;
  for (auto [off, n] : remote.requests) {
    EXPECT_EQ(off % kBlock, 0u);
    EXPECT_EQ(n % kBlock, 0u);
    EXPECT_LE(n, 4 * kBlock);
    for (uint64_t b = off / kBlock; b < (off + n) / kBlock; ++b) EXPECT_TRUE(blocks.insert(b).second) << b;
  }
  EXPECT_LE(*blocks.rbegin(), 64u + 16u);
  // Once the window is open the reader never waits for a fetch of its own,
  // and the window is topped up 4 blocks (one request) at a time.
  EXPECT_EQ(c.stats().misses, 5u);  // blocks 0-1 (first read), 2-3 (window of one block), 5
  ASSERT_GT(remote.requests.size(), 10u);
  for (size_t i = remote.requests.size() - 6; i < remote.requests.size(); ++i)
    EXPECT_EQ(remote.requests[i].second, 4 * kBlock) << i;
  EXPECT_LT(remote.requests.size(), 64u / 2);  // fewer requests than the 2-block reads
}

}  // namespace
}  // namespace qcowfs::io
