// Bounded readahead (io/remote/block_cache.h): read-ahead blocks in flight
// never pass the readahead budget, whatever the access pattern, and the
// budget is free again once they finish.
#include <algorithm>
#include <functional>
#include <map>
#include <vector>

#include <gtest/gtest.h>

#include "io/remote/block_cache.h"
#include "io_test_util.h"

namespace qcowfs::io {
namespace {

using testing::pattern;
using testing::run_now;

// Fetches of blocks the current read needs complete at once; read-ahead
// fetches are held until the test releases them, as on a slow server.
struct HeldRemote {
  std::vector<std::byte> data;
  uint64_t want_first = 0, want_last = 0;  // blocks of the read under way
  uint64_t block = 0;
  std::map<uint64_t, std::function<void(Status)>> held;  // offset -> done
  uint64_t held_bytes = 0, most_held_bytes = 0;

  BlockCache::Fetch fetch() {
    return [this](uint64_t off, BlockCache::Buffers dst, std::function<void(Status)> done) {
      uint64_t at = off;
      for (std::span<std::byte> d : dst) {
        std::copy_n(data.begin() + static_cast<ptrdiff_t>(at), d.size(), d.begin());
        at += d.size();
      }
      if (off / block >= want_first && off / block <= want_last) return done(Status::ok());
      held.emplace(off, std::move(done));
      held_bytes += at - off;
      most_held_bytes = std::max(most_held_bytes, held_bytes);
    };
  }
  void release_all() {
    for (auto& [off, done] : held) done(Status::ok());
    held.clear();
    held_bytes = 0;
  }
};

TEST(BlockCache, ReadaheadInFlightStaysWithinItsBudget) {
  constexpr uint64_t kBlock = 64 * 1024, kBudget = 4 * kBlock;
  HeldRemote remote{pattern(1024 * kBlock, 5), 0, 0, kBlock, {}, 0, 0};
  BlockCache c(remote.data.size(), {kBlock, 256 * kBlock, kBudget}, remote.fetch());
  // Runs of small sequential reads inside one block (each grows the window),
  // then a jump far away: every run would leave a full window in flight.
  std::vector<std::byte> buf(4096);
  for (uint64_t run = 0; run < 16; ++run) {
    const uint64_t base = run * 32 * kBlock;
    remote.want_first = remote.want_last = base / kBlock;
    for (uint64_t off = base; off < base + kBlock; off += buf.size()) {
      auto r = run_now(c.read(off, buf));
      ASSERT_TRUE(r) << r.status().to_string();
      ASSERT_TRUE(std::equal(buf.begin(), buf.end(), remote.data.begin() + static_cast<ptrdiff_t>(off)));
    }
  }
  EXPECT_GT(remote.most_held_bytes, 0u);  // readahead did start
  EXPECT_LE(remote.most_held_bytes, kBudget);
  remote.release_all();
  // The budget is free again once those fetches finished: a new run reads ahead.
  const size_t before = remote.held.size();
  remote.want_first = remote.want_last = 900;
  for (uint64_t off = 900 * kBlock; off < 900 * kBlock + 3 * buf.size(); off += buf.size())
    ASSERT_TRUE(run_now(c.read(off, buf)));
  EXPECT_GT(remote.held.size(), before);
  remote.release_all();
}

}  // namespace
}  // namespace qcowfs::io
