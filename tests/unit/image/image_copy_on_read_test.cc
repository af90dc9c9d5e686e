// Copy-on-read tests (image/copy_on_read.h) over a scripted two-layer driver:
// a read copies the clusters it touches that the top layer lacks (whole, the
// guest seeing the base's bytes), leaves allocated clusters alone, copies
// zeros as write-zeroes, re-checks allocation under its lock (a guest write
// that allocated the cluster meanwhile wins), and is refused read-only.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <set>
#include <vector>

#include "image/copy_on_read.h"
#include "unit/io/io_test_util.h"

namespace qcowfs::image {
namespace {

using io::testing::pattern;
using io::testing::run_now;

constexpr uint64_t kCluster = 64 * 1024;
constexpr uint64_t kSize = 8 * kCluster;
using Ranges = std::vector<std::pair<uint64_t, uint64_t>>;  // (offset, length)

// A top image over a base, both in memory, allocated per cluster. Writes
// allocate the clusters they touch (a partial one copied from the base first).
struct Layers {
  std::vector<std::byte> base = pattern(kSize, 3);
  std::vector<std::byte> top = std::vector<std::byte>(kSize);
  std::set<uint64_t> allocated;                    // cluster indexes in the top
  Ranges writes;  // every write
  Ranges zero_writes;
  // Runs once, as the next block_status returns: a guest write landing
  // between the copy-on-read's first look and its lock.
  std::function<void()> before_next_status;

  void allocate(uint64_t off, std::span<const std::byte> src) {
    for (uint64_t c = off / kCluster; c * kCluster < off + src.size(); ++c) {
      if (allocated.insert(c).second)
        std::memcpy(top.data() + c * kCluster, base.data() + c * kCluster, kCluster);
    }
    std::memcpy(top.data() + off, src.data(), src.size());
  }
};

class TwoLayerDriver final : public BlockDriver {
 public:
  explicit TwoLayerDriver(Layers& l, bool ro = false) : l_(l), ro_(ro) {}
  std::string_view format_name() const override { return "two-layer"; }
  uint64_t size() const override { return kSize; }
  bool read_only() const override { return ro_; }
  size_t mem_align() const override { return 4096; }
  uint64_t allocated_bytes() const override { return l_.allocated.size() * kCluster; }
  ImageDetails details() const override {
    ImageDetails d;
    d.cluster_size = kCluster;
    d.backing_file = "base";
    return d;
  }
  Task<Status> read(uint64_t off, std::span<std::byte> buf) override {
    for (uint64_t i = 0; i < buf.size(); ++i) {
      const uint64_t at = off + i;
      buf[i] = l_.allocated.contains(at / kCluster) ? l_.top[at] : l_.base[at];
    }
    co_return Status::ok();
  }
  Task<Status> write(uint64_t off, std::span<const std::byte> buf) override {
    l_.writes.emplace_back(off, buf.size());
    l_.allocate(off, buf);
    co_return Status::ok();
  }
  Task<Status> write_zeroes(uint64_t off, uint64_t len, bool) override {
    l_.zero_writes.emplace_back(off, len);
    l_.allocate(off, std::vector<std::byte>(len));
    co_return Status::ok();
  }
  Task<Status> flush() override { co_return Status::ok(); }
  Task<Status> discard(uint64_t, uint64_t) override { co_return Status::ok(); }
  Task<Status> truncate(uint64_t) override { co_return Status::ok(); }
  Task<Result<BlockStatus>> block_status(uint64_t off, uint64_t len) override {
    const bool in_top = l_.allocated.contains(off / kCluster);
    uint64_t end = (off / kCluster + 1) * kCluster;
    while (end < off + len && l_.allocated.contains(end / kCluster) == in_top) end += kCluster;
    BlockStatus s;
    s.length = std::min(end, off + len) - off;
    s.present = true;
    s.data = true;
    s.depth = in_top ? 0 : 1;
    if (auto hook = std::exchange(l_.before_next_status, nullptr)) hook();
    co_return s;
  }
  Task<Status> close() override { co_return Status::ok(); }

 private:
  Layers& l_;
  bool ro_;
};

std::unique_ptr<BlockDriver> cor(Layers& l) {
  auto d = make_copy_on_read(std::make_unique<TwoLayerDriver>(l));
  EXPECT_TRUE(d) << d.status().to_string();
  return std::move(*d);
}

std::vector<std::byte> read(BlockDriver& d, uint64_t off, size_t n) {
  std::vector<std::byte> out(n);
  Status st = run_now(d.read(off, out));
  EXPECT_TRUE(st) << st.to_string();
  return out;
}

bool equals_at(const std::vector<std::byte>& image, uint64_t off, const std::vector<std::byte>& got) {
  return std::equal(got.begin(), got.end(), image.begin() + static_cast<ptrdiff_t>(off));
}

TEST(CopyOnRead, ReadCopiesWholeClustersAndShowsTheBase) {
  Layers l;
  auto d = cor(l);
  auto got = read(*d, kCluster - 100, 200);  // two clusters, a few bytes of each
  EXPECT_TRUE(equals_at(l.base, kCluster - 100, got));
  EXPECT_EQ(l.allocated, (std::set<uint64_t>{0, 1}));
  EXPECT_EQ(l.writes, (Ranges{{0, 2 * kCluster}}));
  EXPECT_TRUE(std::equal(l.top.begin(), l.top.begin() + 2 * kCluster, l.base.begin()));
  read(*d, 10, 10);  // now allocated: no copy
  EXPECT_EQ(l.writes.size(), 1u);
}

TEST(CopyOnRead, AllocatedClustersAreNotCopiedOver) {
  Layers l;
  auto d = cor(l);
  const auto mine = pattern(kCluster, 9);
  ASSERT_TRUE(run_now(d->write(3 * kCluster, mine)));
  l.writes.clear();
  auto got = read(*d, 2 * kCluster + 5, 3 * kCluster);  // clusters 2, 3 (the guest's), 4, 5
  EXPECT_TRUE(std::equal(mine.begin(), mine.end(), got.begin() + kCluster - 5));
  EXPECT_EQ(l.writes, (Ranges{{2 * kCluster, kCluster}, {4 * kCluster, 2 * kCluster}}));
  EXPECT_TRUE(std::equal(mine.begin(), mine.end(), l.top.begin() + 3 * kCluster));
}

TEST(CopyOnRead, ZerosAreCopiedAsWriteZeroes) {
  Layers l;
  std::fill(l.base.begin() + 6 * kCluster, l.base.begin() + 7 * kCluster, std::byte{0});
  auto d = cor(l);
  auto got = read(*d, 6 * kCluster + 1, 100);
  EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](std::byte b) { return b == std::byte{0}; }));
  EXPECT_TRUE(l.writes.empty());
  EXPECT_EQ(l.zero_writes, (Ranges{{6 * kCluster, kCluster}}));
}

TEST(CopyOnRead, GuestWriteBetweenLookAndLockWins) {
  Layers l;
  auto d = cor(l);
  const auto mine = pattern(kCluster, 11);
  // The read's first look sees cluster 5 unallocated; a guest write then
  // allocates it before the copy takes its lock and looks again.
  l.before_next_status = [&] { l.allocate(5 * kCluster, mine); };
  auto got = read(*d, 5 * kCluster, 4096);
  EXPECT_TRUE(std::equal(got.begin(), got.end(), mine.begin()));
  EXPECT_TRUE(l.writes.empty());
  EXPECT_TRUE(std::equal(mine.begin(), mine.end(), l.top.begin() + 5 * kCluster));
}

TEST(CopyOnRead, RefusedOnAReadOnlyImage) {
  Layers l;
  auto d = make_copy_on_read(std::make_unique<TwoLayerDriver>(l, true));
  ASSERT_FALSE(d);
  EXPECT_EQ(d.status().code(), EINVAL);
}

}  // namespace
}  // namespace qcowfs::image
