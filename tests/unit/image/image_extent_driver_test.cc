// ExtentDriver over a scripted ExtentMap and MemFiles: host-contiguous extents
// become one host read, zero and unallocated extents are filled or read from
// the backing image, compressed units are decompressed once, block_status
// merges extents as qemu-img map prints them, and bad extents are EIO.
#include <gtest/gtest.h>

#include <cstring>
#include <set>

#include "image/extent/driver.h"
#include "image/raw/raw.h"
#include "io/buffer.h"
#include "io/engine.h"
#include "io/mem_file.h"
#include "io/run_sync.h"
#include "unit/io/io_test_util.h"

namespace qcowfs::image {
namespace {

using io::testing::run_now;

constexpr uint64_t kBlock = 4096;
constexpr uint64_t kBlocks = 16;

std::vector<std::byte> pattern(size_t n, uint8_t seed) {
  std::vector<std::byte> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<std::byte>(seed + i * 7);
  return v;
}

// One entry per guest block: its kind and (data) host block. Blocks listed in
// `cold` are not "in memory": try_map says so and map() answers.
class ScriptedMap final : public ExtentMap {
 public:
  struct Block {
    ExtentKind kind = ExtentKind::unallocated;
    uint64_t host_block = 0;
  };
  std::vector<Block> blocks = std::vector<Block>(kBlocks);
  std::set<uint64_t> cold;
  io::HostFile* file = nullptr;
  mutable int decompressions = 0;
  int slow_maps = 0;

  Result<std::optional<Extent>> try_map(uint64_t guest, uint64_t len) override {
    if (cold.count(guest / kBlock)) return std::optional<Extent>();
    return std::optional<Extent>(extent(guest, len));
  }
  Task<Result<Extent>> map(uint64_t guest, uint64_t len) override {
    ++slow_maps;
    co_return extent(guest, len);
  }
  Status decompress(const Extent& e, std::span<const std::byte> stream, std::span<std::byte> out) const override {
    ++decompressions;
    if (stream.size() != e.stored_size) return Status::error(EIO, "wrong stream size");
    for (size_t i = 0; i < out.size(); ++i) out[i] = stream[i % stream.size()];
    return Status::ok();
  }

 private:
  Extent extent(uint64_t guest, uint64_t len) const {
    const Block& b = blocks[guest / kBlock];
    Extent e;
    e.kind = b.kind;
    e.length = std::min(len, kBlock - guest % kBlock);
    // Zero and unallocated extents name no host space (as in every format
    // but qcow2's ZERO_ALLOC, image/extent/map.h).
    if (b.kind == ExtentKind::data || b.kind == ExtentKind::compressed) e.file = file;
    e.host_offset = b.host_block * kBlock + guest % kBlock;
    if (b.kind == ExtentKind::compressed) {
      e.host_offset = b.host_block * kBlock;
      e.unit_offset = guest % kBlock;
      e.unit_size = kBlock;
      e.stored_size = 100;
    }
    return e;
  }
};

struct Fixture {
  io::MemFile* host = nullptr;
  ScriptedMap* map = nullptr;
  std::unique_ptr<ExtentDriver> driver;
};

Fixture make(std::vector<ScriptedMap::Block> blocks, std::unique_ptr<BlockDriver> backing = nullptr,
             std::set<uint64_t> cold = {}) {
  Fixture f;
  auto host = std::make_unique<io::MemFile>(io::MemFileOptions{}, pattern(kBlocks * kBlock, 1));
  auto map = std::make_unique<ScriptedMap>();
  f.host = host.get();
  f.map = map.get();
  map->file = host.get();
  map->blocks = std::move(blocks);
  map->blocks.resize(kBlocks);
  map->cold = std::move(cold);
  ExtentImage img;
  img.format = "test";
  img.path = "mem";
  img.size = kBlocks * kBlock;
  img.files.push_back(std::move(host));
  img.map = std::move(map);
  img.backing = std::move(backing);
  img.compressed_unit_size = kBlock;
  f.driver = std::make_unique<ExtentDriver>(std::move(img));
  return f;
}

using K = ExtentKind;

std::vector<std::byte> read_all(BlockDriver& d, uint64_t off, size_t n) {
  io::AlignedBuffer buf(n, 4096, false);
  Status st = run_now(d.read(off, buf.span()));
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  return std::vector<std::byte>(buf.data(), buf.data() + n);
}

TEST(ExtentDriver, HostContiguousBlocksAreOneHostRead) {
  Fixture f = make({{K::data, 5}, {K::data, 6}, {K::data, 7}, {K::data, 2}});
  const auto host = pattern(kBlocks * kBlock, 1);
  auto got = read_all(*f.driver, 0, 4 * kBlock);
  EXPECT_EQ(f.host->counters().reads, 2u);  // blocks 5-7, then block 2
  EXPECT_EQ(0, std::memcmp(got.data(), host.data() + 5 * kBlock, 3 * kBlock));
  EXPECT_EQ(0, std::memcmp(got.data() + 3 * kBlock, host.data() + 2 * kBlock, kBlock));
}

TEST(ExtentDriver, ZeroAndUnallocatedReadZerosWithoutBacking) {
  Fixture f = make({{K::zero, 0}, {K::unallocated, 0}});
  auto got = read_all(*f.driver, 100, 2 * kBlock - 200);
  for (std::byte b : got) ASSERT_EQ(b, std::byte{0});
  EXPECT_EQ(f.host->counters().reads, 0u);
}

TEST(ExtentDriver, UnallocatedRunsReadTheBackingImageOnce) {
  auto base_file = std::make_unique<io::MemFile>(io::MemFileOptions{}, pattern(3 * kBlock, 9));
  io::MemFile* base_host = base_file.get();
  auto base = std::make_unique<RawDriver>(std::move(base_file), false);
  Fixture f = make({{K::unallocated, 0}, {K::unallocated, 0}, {K::unallocated, 0}, {K::unallocated, 0}},
                   std::move(base));
  auto got = read_all(*f.driver, 0, 4 * kBlock);
  const auto want = pattern(3 * kBlock, 9);
  EXPECT_EQ(0, std::memcmp(got.data(), want.data(), 3 * kBlock));
  for (size_t i = 3 * kBlock; i < 4 * kBlock; ++i) ASSERT_EQ(got[i], std::byte{0}) << "past the backing end";
  EXPECT_EQ(base_host->counters().reads, 1u);
}

TEST(ExtentDriver, CompressedUnitsAreDecompressedOnce) {
  // Decompression runs on a worker thread (io::offload): this needs an engine.
  auto engine = io::make_engine(io::EngineKind::threads);
  ASSERT_TRUE(engine.is_ok());
  Fixture f = make({{K::compressed, 3}});
  const auto host = pattern(kBlocks * kBlock, 1);
  io::AlignedBuffer a(512, 4096, false), b(512, 4096, false);
  ASSERT_TRUE(io::run_sync(**engine, f.driver->read(0, a.span())).is_ok());
  ASSERT_TRUE(io::run_sync(**engine, f.driver->read(1000, b.span())).is_ok());
  EXPECT_EQ(f.map->decompressions, 1);
  EXPECT_EQ(a.data()[0], host[3 * kBlock]);
  EXPECT_EQ(b.data()[0], host[3 * kBlock + 1000 % 100]);
}

TEST(ExtentDriver, MetadataNotInMemoryGoesThroughMap) {
  Fixture f = make({{K::data, 1}, {K::data, 2}}, nullptr, {1});
  auto got = read_all(*f.driver, 0, 2 * kBlock);
  EXPECT_EQ(f.map->slow_maps, 1);
  EXPECT_EQ(f.host->counters().reads, 1u);  // still one host read: blocks 1-2 are contiguous
}

TEST(ExtentDriver, BlockStatusMergesLikeQemuImgMap) {
  Fixture f = make({{K::data, 4}, {K::data, 5}, {K::data, 9}, {K::zero, 0}, {K::zero, 0}, {K::compressed, 1}});
  auto s = run_now(f.driver->block_status(0, kBlocks * kBlock));
  ASSERT_TRUE(s.is_ok());
  EXPECT_EQ(s->length, 2 * kBlock);
  EXPECT_TRUE(s->data && s->present && !s->zero);
  EXPECT_EQ(s->host_offset, 4 * kBlock);
  s = run_now(f.driver->block_status(2 * kBlock, kBlocks * kBlock - 2 * kBlock));
  EXPECT_EQ(s->length, kBlock);
  EXPECT_EQ(s->host_offset, 9 * kBlock);
  s = run_now(f.driver->block_status(3 * kBlock, kBlocks * kBlock - 3 * kBlock));
  EXPECT_EQ(s->length, 2 * kBlock);
  EXPECT_TRUE(s->zero && s->present && !s->data);
  s = run_now(f.driver->block_status(5 * kBlock, kBlocks * kBlock - 5 * kBlock));
  EXPECT_EQ(s->length, kBlock);
  EXPECT_TRUE(s->data && s->file == nullptr);
  s = run_now(f.driver->block_status(6 * kBlock, kBlocks * kBlock - 6 * kBlock));
  EXPECT_EQ(s->length, (kBlocks - 6) * kBlock);
  EXPECT_TRUE(s->zero && !s->present && !s->data);
}

class BadLengthMap final : public ExtentMap {
 public:
  Result<std::optional<Extent>> try_map(uint64_t, uint64_t len) override {
    Extent e;
    e.kind = ExtentKind::zero;
    e.length = len + 1;  // longer than asked: a format bug, never trusted
    return std::optional<Extent>(e);
  }
};

TEST(ExtentDriver, AnExtentLongerThanAskedIsEio) {
  ExtentImage img;
  img.format = "test";
  img.size = kBlock;
  img.map = std::make_unique<BadLengthMap>();
  ExtentDriver d(std::move(img));
  io::AlignedBuffer buf(512, 4096, false);
  EXPECT_EQ(run_now(d.read(0, buf.span())).code(), EIO);
  EXPECT_EQ(run_now(d.block_status(0, kBlock)).status().code(), EIO);
}

TEST(ExtentDriver, WritesAreRefusedReadOnly) {
  Fixture f = make({});
  std::vector<std::byte> data(512);
  EXPECT_EQ(run_now(f.driver->write(0, data)).code(), EROFS);
  EXPECT_EQ(run_now(f.driver->write_zeroes(0, 512, false)).code(), EROFS);
  EXPECT_EQ(run_now(f.driver->truncate(0)).code(), EROFS);
  EXPECT_TRUE(f.driver->read_only());
}

}  // namespace
}  // namespace qcowfs::image
