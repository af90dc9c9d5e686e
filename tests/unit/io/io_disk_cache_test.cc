// DiskCache tests (io/remote/disk_cache.h): blocks kept across instances (a
// second mount reads them without the remote), an identity change empties the
// entry, a damaged block is fetched again rather than served, a held entry is
// not shared, an object without ETag or Last-Modified is not cached, and
// entries of other objects are removed to stay within the limit.
// The remote here is an in-memory pattern that counts its fetches.
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <filesystem>
#include <future>
#include <vector>

#include <gtest/gtest.h>

#include "io/remote/disk_cache.h"
#include "io_test_util.h"

namespace qcowfs::io {
namespace {

using testing::pattern;

constexpr uint64_t kBlock = 64 * 1024;
constexpr uint64_t kSize = 4 * kBlock + 1000;  // a short last block

class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    path_ = fmt::format("/var/tmp/qcowfs_io_diskcache_{}_{}", ::getpid(), counter++);
    std::filesystem::remove_all(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

struct FakeRemote {
  std::vector<std::byte> data = pattern(kSize, 7);
  std::atomic<int> fetches{0};
  BlockCache::Fetch fetch() {
    return [this](uint64_t off, BlockCache::Buffers dst, std::function<void(Status)> done) {
      ++fetches;
      for (std::span<std::byte> d : dst) {
        std::copy_n(data.begin() + static_cast<ptrdiff_t>(off), d.size(), d.begin());
        off += d.size();
      }
      done(Status::ok());
    };
  }
};

ObjectIdentity identity(std::string etag = "\"v1\"") {
  return ObjectIdentity{"http://user:pw@127.0.0.1:8080/base.qcow2?sig=1", kSize, std::move(etag), "Fri, 04 Dec 2026"};
}

std::unique_ptr<DiskCache> open_cache(const std::string& dir, const ObjectIdentity& id,
                                      uint64_t limit = uint64_t{1} << 30) {
  auto c = DiskCache::open(DiskCacheConfig{dir, limit, kBlock}, id);
  EXPECT_TRUE(c) << c.status().to_string();
  return c ? std::move(*c) : nullptr;
}

// Block index through fetch, waiting for done; the bytes.
std::vector<std::byte> get(const BlockCache::Fetch& fetch, uint64_t index) {
  std::vector<std::byte> out(std::min(kBlock, kSize - index * kBlock));
  std::promise<Status> p;
  fetch(index * kBlock, {out}, [&p](Status st) { p.set_value(std::move(st)); });
  Status st = p.get_future().get();
  EXPECT_TRUE(st) << st.to_string();
  return out;
}

// Blocks [first, first + n) through one fetch of adjacent buffers; their bytes, together.
std::vector<std::byte> get_blocks(const BlockCache::Fetch& fetch, uint64_t first, uint64_t n) {
  std::vector<std::byte> out(std::min((first + n) * kBlock, kSize) - first * kBlock);
  BlockCache::Buffers bufs;
  for (uint64_t at = 0; at < out.size(); at += kBlock)
    bufs.push_back(std::span(out).subspan(at, std::min<uint64_t>(kBlock, out.size() - at)));
  std::promise<Status> p;
  fetch(first * kBlock, std::move(bufs), [&p](Status st) { p.set_value(std::move(st)); });
  Status st = p.get_future().get();
  EXPECT_TRUE(st) << st.to_string();
  return out;
}

bool same_as_remote(const FakeRemote& r, uint64_t index, const std::vector<std::byte>& got) {
  return std::equal(got.begin(), got.end(), r.data.begin() + static_cast<ptrdiff_t>(index * kBlock));
}

TEST(DiskCache, SecondInstanceReadsKeptBlocksWithoutTheRemote) {
  TempDir dir;
  FakeRemote remote;
  {
    auto c = open_cache(dir.path(), identity());
    ASSERT_TRUE(c);
    auto f = c->wrap(remote.fetch());
    get(f, 0);
    get(f, 4);  // the short last block
    EXPECT_EQ(remote.fetches, 2);
  }  // destruction writes what was queued
  auto c = open_cache(dir.path(), identity());
  ASSERT_TRUE(c);
  auto f = c->wrap(remote.fetch());
  EXPECT_TRUE(same_as_remote(remote, 0, get(f, 0)));
  EXPECT_TRUE(same_as_remote(remote, 4, get(f, 4)));
  EXPECT_EQ(remote.fetches, 2);
  EXPECT_EQ(c->stats().hits, 2u);
  EXPECT_TRUE(same_as_remote(remote, 1, get(f, 1)));  // never kept: fetched
  EXPECT_EQ(remote.fetches, 3);
  // The entry is named by the URL without user info or query.
  EXPECT_EQ(c->path(), dir.path() + "/" + DiskCache::entry_name("http://127.0.0.1:8080/base.qcow2"));
}

TEST(DiskCache, OneRequestOfSeveralBlocksKeepsEachBlock) {
  TempDir dir;
  FakeRemote remote;
  {
    auto c = open_cache(dir.path(), identity());
    ASSERT_TRUE(c);
    auto f = c->wrap(remote.fetch());
    get_blocks(f, 2, 3);  // blocks 2-4 (4 is the short last one) in one request
    EXPECT_EQ(remote.fetches, 1);
  }
  auto c = open_cache(dir.path(), identity());
  ASSERT_TRUE(c);
  auto f = c->wrap(remote.fetch());
  EXPECT_TRUE(same_as_remote(remote, 2, get_blocks(f, 2, 3)));  // each block from the disk
  EXPECT_EQ(remote.fetches, 1);
  EXPECT_EQ(c->stats().hits, 3u);
  EXPECT_TRUE(same_as_remote(remote, 1, get_blocks(f, 1, 2)));  // block 1 from the remote, 2 from the disk
  EXPECT_EQ(remote.fetches, 2);
  EXPECT_EQ(c->stats().hits, 4u);
}

TEST(DiskCache, ChangedIdentityEmptiesTheEntry) {
  TempDir dir;
  FakeRemote remote;
  {
    auto c = open_cache(dir.path(), identity("\"v1\""));
    auto f = c->wrap(remote.fetch());
    get(f, 0);
  }
  FakeRemote replaced;
  replaced.data = pattern(kSize, 8);
  auto c = open_cache(dir.path(), identity("\"v2\""));
  auto f = c->wrap(replaced.fetch());
  EXPECT_TRUE(same_as_remote(replaced, 0, get(f, 0)));
  EXPECT_EQ(replaced.fetches, 1);
  EXPECT_EQ(c->stats().hits, 0u);
}

TEST(DiskCache, DamagedBlockIsFetchedAgainNotServed) {
  TempDir dir;
  FakeRemote remote;
  std::string data_path;
  {
    auto c = open_cache(dir.path(), identity());
    auto f = c->wrap(remote.fetch());
    get(f, 1);
    data_path = c->path() + "/data";
  }
  {
    // A torn write after a crash: bytes of the block differ from its record.
    std::fstream file(data_path, std::ios::in | std::ios::out | std::ios::binary);
    file.seekg(static_cast<std::streamoff>(kBlock + 100));
    const char old = static_cast<char>(file.get());
    file.seekp(static_cast<std::streamoff>(kBlock + 100));
    file.put(static_cast<char>(old ^ 0x5a));
  }
  auto c = open_cache(dir.path(), identity());
  auto f = c->wrap(remote.fetch());
  EXPECT_TRUE(same_as_remote(remote, 1, get(f, 1)));
  EXPECT_EQ(remote.fetches, 2);
  EXPECT_EQ(c->stats().bad, 1u);
}

TEST(DiskCache, HeldEntryIsNotShared) {
  TempDir dir;
  auto first = open_cache(dir.path(), identity());
  ASSERT_TRUE(first);
  auto second = DiskCache::open(DiskCacheConfig{dir.path(), uint64_t{1} << 30, kBlock}, identity());
  ASSERT_TRUE(second);
  EXPECT_FALSE(*second);  // runs without the disk cache
}

TEST(DiskCache, ObjectWithoutEtagOrLastModifiedIsNotCached) {
  TempDir dir;
  ObjectIdentity id = identity("");
  id.last_modified.clear();
  auto c = DiskCache::open(DiskCacheConfig{dir.path(), uint64_t{1} << 30, kBlock}, id);
  ASSERT_TRUE(c);
  EXPECT_FALSE(*c);
}

TEST(DiskCache, OtherEntriesAreRemovedToStayWithinTheLimit) {
  TempDir dir;
  FakeRemote remote;
  std::string old_entry;
  {
    auto c = open_cache(dir.path(), identity());
    auto f = c->wrap(remote.fetch());
    for (uint64_t i = 0; i < 5; ++i) get(f, i);
    old_entry = c->path();
  }
  ObjectIdentity other = identity();
  other.url = "http://127.0.0.1:8080/other.qcow2";
  auto c = open_cache(dir.path(), other, 2 * kBlock);
  ASSERT_TRUE(c);
  EXPECT_FALSE(std::filesystem::exists(old_entry));
  auto f = c->wrap(remote.fetch());
  for (uint64_t i = 0; i < 5; ++i) get(f, i);
  c.reset();
  // Within its limit: two blocks kept, the rest fetched again.
  auto again = open_cache(dir.path(), other, 2 * kBlock);
  auto g = again->wrap(remote.fetch());
  const int before = remote.fetches;
  for (uint64_t i = 0; i < 5; ++i) get(g, i);
  EXPECT_EQ(remote.fetches - before, 3);
}

}  // namespace
}  // namespace qcowfs::io
