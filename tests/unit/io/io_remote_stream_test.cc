// Sequential streams through a BlockCache (io/remote/block_cache.h) with the
// HTTP defaults' proportions (256 KiB blocks, 64 MiB cache, 16 MiB readahead,
// requests of up to 2 MiB; scaled down 16 times here to keep the test quick),
// read as fio's 1 MiB sequential job at QD8 does: eight reads
// in flight, a new one at the next offset as each completes, fetches answered
// one at a time in the order they were made (one network stream). The eight
// readers must ride one readahead stream of coalesced requests (not each
// fetch its own megabyte), and a long stream must recycle its block buffers
// (not allocate fresh ones for each readahead once the cache is full).
#include <algorithm>
#include <deque>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "io/engine.h"
#include "io/remote/block_cache.h"
#include "io_test_util.h"

namespace qcowfs::io {
namespace {

// 1/16 of the defaults: a "MiB" of 64 KiB.
constexpr uint64_t kKiB = 1024, kMiB = 64 * kKiB;
constexpr uint64_t kBlock = kMiB / 4, kRequest = 2 * kMiB;
constexpr uint64_t kRead = kMiB;

// Every fetch is held until release_one() answers the oldest.
struct QueuedRemote {
  std::vector<std::byte> data;
  std::deque<std::pair<std::function<void()>, std::function<void(Status)>>> held = {};
  std::vector<std::pair<uint64_t, uint64_t>> requests = {};  // (offset, bytes), in order

  BlockCache::Fetch fetch() {
    return [this](uint64_t off, BlockCache::Buffers dst, std::function<void(Status)> done) {
      uint64_t len = 0;
      for (const auto& d : dst) len += d.size();
      requests.emplace_back(off, len);
      auto fill = [this, off, dst = std::move(dst)] {
        uint64_t at = off;
        for (std::span<std::byte> d : dst) {
          std::copy_n(data.begin() + static_cast<ptrdiff_t>(at), d.size(), d.begin());
          at += d.size();
        }
      };
      held.emplace_back(std::move(fill), std::move(done));
    };
  }
  bool release_one() {
    if (held.empty()) return false;
    auto [fill, done] = std::move(held.front());
    held.pop_front();
    fill();
    done(Status::ok());
    return true;
  }
};

class StreamTest : public testing::ThreadsEngineTest {
 protected:

  // Reads [0, total) in kRead pieces with depth reads in flight (wrapping at
  // the object's end), answering the oldest fetch (or, with burst, every
  // fetch under way) whenever every read waits; checks every byte.
  void stream(BlockCache& c, QueuedRemote& remote, uint64_t total, unsigned depth, bool burst = false) {
    struct Read {
      uint64_t off = 0;
      std::vector<std::byte> buf = std::vector<std::byte>(kRead);
      bool done = false;
      Result<size_t> result = size_t{0};
    };
    std::deque<std::unique_ptr<Read>> in_flight;
    uint64_t next = 0, finished = 0;
    auto submit = [&] {
      auto r = std::make_unique<Read>();
      r->off = next % remote.data.size();
      next += kRead;
      auto task = [](BlockCache& cache, Read& rd) -> Task<void> {
        rd.result = co_await cache.read(rd.off, rd.buf);
        rd.done = true;
      };
      spawn(task(c, *r));
      in_flight.push_back(std::move(r));
    };
    while (finished < total) {
      while (in_flight.size() < depth && next < total) submit();
      settle();
      bool progress = false;
      while (!in_flight.empty() && in_flight.front()->done) {
        const Read& r = *in_flight.front();
        ASSERT_TRUE(r.result) << r.result.status().to_string();
        ASSERT_EQ(*r.result, kRead);
        ASSERT_TRUE(std::equal(r.buf.begin(), r.buf.end(), remote.data.begin() + static_cast<ptrdiff_t>(r.off)))
            << "at " << r.off;
        in_flight.pop_front();
        finished += kRead;
        progress = true;
      }
      if (!progress) {
        ASSERT_TRUE(remote.release_one()) << "reads wait for nothing under way at " << finished;
        while (burst && remote.release_one()) {
        }
      }
    }
    while (remote.release_one()) settle();  // read-ahead past the end
  }

};

// The HTTP defaults, scaled (http_file.cc: requests of readahead / connections).
BlockCacheConfig http_defaults() { return {kBlock, 64 * kMiB, 16 * kMiB, kRequest, 4 * kKiB}; }

TEST_F(StreamTest, ConcurrentSequentialReadersShareOneStream) {
  QueuedRemote remote{testing::pattern(48 * kMiB, 7)};
  BlockCache c(remote.data.size(), http_defaults(), remote.fetch());
  constexpr uint64_t kTotal = 48 * kMiB;
  stream(c, remote, kTotal, 8);
  // Each byte is fetched once (the cache holds the whole object) ...
  uint64_t fetched = 0;
  for (auto [off, len] : remote.requests) fetched += len;
  EXPECT_EQ(fetched, kTotal);
  EXPECT_EQ(c.stats().bytes_fetched, kTotal);
  // ... and, past the first reads (before the window has grown), in
  // requests of the readahead's size, not each reader's megabyte.
  uint64_t big = 0, big_bytes = 0;
  for (auto [off, len] : remote.requests) {
    if (len == kRequest) {
      ++big;
      big_bytes += len;
    }
  }
  EXPECT_GE(big_bytes, kTotal - 8 * kMiB) << remote.requests.size() << " requests";
  EXPECT_LE(remote.requests.size(), big + 16);
}

TEST_F(StreamTest, LongStreamRecyclesItsBlockBuffers) {
  QueuedRemote remote{testing::pattern(160 * kMiB, 8)};
  BlockCache c(remote.data.size(), http_defaults(), remote.fetch());
  // Twice over an object larger than the cache, fetches answered in bursts
  // (a fast network: eviction and readahead come in bursts too).
  stream(c, remote, 320 * kMiB, 8, true);
  const BlockCacheStats s = c.stats();
  EXPECT_GE(s.bytes_fetched, 320 * kMiB - 64 * kMiB);  // the cache did turn over
  // Buffers are made only while the cache fills: at most its capacity plus
  // the readahead budget and the reads under way, in blocks.
  EXPECT_LE(s.buffers, ((64 + 16) * kMiB + 8 * kRead) / kBlock);
}

}  // namespace
}  // namespace qcowfs::io
