// Compressed cluster encoding and decoding (raw deflate and zstd) and the
// decompressed cluster cache.
#include <gtest/gtest.h>
#include <zlib.h>
#include <zstd.h>

#include <algorithm>
#include <random>
#include <thread>
#include <vector>

#include "image/extent/cluster_cache.h"
#include "image/qcow2/compress.h"
#include "image/qcow2/format.h"

namespace qcowfs::image::qcow2 {
namespace {

using Bytes = std::vector<std::byte>;

Bytes pattern(size_t n) {
  Bytes b(n);
  for (size_t i = 0; i < n; ++i) b[i] = std::byte(static_cast<uint8_t>((i * 7) ^ (i >> 9)));
  return b;
}

Bytes deflate_raw(const Bytes& in) {
  z_stream s{};
  EXPECT_EQ(deflateInit2(&s, Z_DEFAULT_COMPRESSION, Z_DEFLATED, -12, 9, Z_DEFAULT_STRATEGY), Z_OK);
  Bytes out(in.size() + 1024);
  s.next_in = reinterpret_cast<Bytef*>(const_cast<std::byte*>(in.data()));
  s.avail_in = static_cast<uInt>(in.size());
  s.next_out = reinterpret_cast<Bytef*>(out.data());
  s.avail_out = static_cast<uInt>(out.size());
  EXPECT_EQ(deflate(&s, Z_FINISH), Z_STREAM_END);
  out.resize(out.size() - s.avail_out);
  deflateEnd(&s);
  return out;
}

Bytes zstd(const Bytes& in) {
  Bytes out(ZSTD_compressBound(in.size()));
  size_t n = ZSTD_compress(out.data(), out.size(), in.data(), in.size(), 3);
  EXPECT_FALSE(ZSTD_isError(n));
  out.resize(n);
  return out;
}

TEST(Qcow2Compress, DeflateClusterDecodes) {
  Bytes plain = pattern(65536);
  Bytes packed = deflate_raw(plain);
  packed.resize(packed.size() + 300, std::byte{0x5a});  // bytes of the next stream in the last sector
  Bytes out(65536);
  ASSERT_TRUE(decompress_cluster(kCompressionZlib, packed, out).is_ok());
  EXPECT_EQ(out, plain);
}

TEST(Qcow2Compress, ZstdClusterDecodes) {
  Bytes plain = pattern(65536);
  Bytes packed = zstd(plain);
  packed.resize(packed.size() + 300, std::byte{0});
  Bytes out(65536);
  Status st = decompress_cluster(kCompressionZstd, packed, out);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(out, plain);
}

TEST(Qcow2Compress, TruncatedDeflateStreamIsEio) {
  Bytes packed = deflate_raw(pattern(65536));
  packed.resize(packed.size() / 2);
  Bytes out(65536);
  EXPECT_EQ(decompress_cluster(kCompressionZlib, packed, out).code(), EIO);
}

TEST(Qcow2Compress, TruncatedZstdStreamIsEio) {
  Bytes packed = zstd(pattern(65536));
  packed.resize(packed.size() / 2);
  Bytes out(65536);
  EXPECT_EQ(decompress_cluster(kCompressionZstd, packed, out).code(), EIO);
}

TEST(Qcow2Compress, GarbageInputIsEio) {
  Bytes garbage(4096, std::byte{0xff});
  Bytes out(65536);
  EXPECT_EQ(decompress_cluster(kCompressionZlib, garbage, out).code(), EIO);
  EXPECT_EQ(decompress_cluster(kCompressionZstd, garbage, out).code(), EIO);
}

TEST(Qcow2Compress, StreamShorterThanClusterIsEio) {
  Bytes packed = deflate_raw(pattern(4096));
  Bytes out(65536);
  EXPECT_EQ(decompress_cluster(kCompressionZlib, packed, out).code(), EIO);
  Bytes zpacked = zstd(pattern(4096));
  EXPECT_EQ(decompress_cluster(kCompressionZstd, zpacked, out).code(), EIO);
}

TEST(Qcow2Compress, ZstdStreamLongerThanClusterIsEio) {
  Bytes packed = zstd(pattern(131072));
  Bytes out(65536);
  EXPECT_EQ(decompress_cluster(kCompressionZstd, packed, out).code(), EIO);
}

Bytes random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  Bytes b(n);
  for (auto& x : b) x = std::byte(static_cast<uint8_t>(rng()));
  return b;
}

Result<Bytes> compress(uint8_t type, const Bytes& in) {
  Bytes out(in.size() - 1);  // as the writer offers: one byte short of a cluster
  auto n = compress_cluster(type, in, out);
  if (!n) return n.status();
  out.resize(*n);
  return out;
}

// The writer's deflate stream is byte for byte what QEMU's parameters give
// (raw deflate, window bits -12, default level, memLevel 9), also when the
// per-thread context is reused, and it decodes back.
TEST(Qcow2Compress, DeflateClusterIsQemusStream) {
  const Bytes plain = pattern(65536);
  auto packed = compress(kCompressionZlib, plain);
  ASSERT_TRUE(packed) << packed.status().to_string();
  EXPECT_EQ(*packed, deflate_raw(plain));
  auto again = compress(kCompressionZlib, plain);
  ASSERT_TRUE(again);
  EXPECT_EQ(*again, *packed);
  Bytes out(65536);
  ASSERT_TRUE(decompress_cluster(kCompressionZlib, *packed, out).is_ok());
  EXPECT_EQ(out, plain);
}

TEST(Qcow2Compress, ZstdClusterRoundTrips) {
  const Bytes plain = pattern(65536);
  auto packed = compress(kCompressionZstd, plain);
  ASSERT_TRUE(packed) << packed.status().to_string();
  EXPECT_LT(packed->size(), plain.size() / 2);
  Bytes out(65536);
  Status st = decompress_cluster(kCompressionZstd, *packed, out);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(out, plain);
}

// Random data does not shrink below a cluster: 0, the cluster is stored as it
// is; the context is usable afterwards (an unfinished stream is dropped).
TEST(Qcow2Compress, IncompressibleClusterGivesZero) {
  const Bytes noise = random_bytes(65536, 3);
  const Bytes plain = pattern(65536);
  for (uint8_t type : {kCompressionZlib, kCompressionZstd}) {
    auto packed = compress(type, noise);
    ASSERT_TRUE(packed) << packed.status().to_string();
    EXPECT_TRUE(packed->empty()) << "type " << int{type};
    auto next = compress(type, plain);
    ASSERT_TRUE(next);
    Bytes out(65536);
    ASSERT_TRUE(decompress_cluster(type, *next, out).is_ok());
    EXPECT_EQ(out, plain);
  }
}

// Evenly spread bytes skip deflate only when nothing a 4 KiB window could
// match is there: noise is skipped (and stored uncompressed, as deflate would
// not shrink it), but not a regular sweep of all byte values, a short block
// of noise repeated, nor noise with a run of zeros, all of which deflate shrinks.
TEST(Qcow2Compress, OnlyIrregularEvenBytesSkipDeflate) {
  EXPECT_TRUE(looks_incompressible(random_bytes(65536, 5)));
  Bytes sweep(65536);
  for (size_t i = 0; i < sweep.size(); ++i) sweep[i] = std::byte(static_cast<uint8_t>(i));
  Bytes repeated(65536);
  const Bytes block = random_bytes(2048, 6);
  for (size_t i = 0; i < repeated.size(); ++i) repeated[i] = block[i % block.size()];
  Bytes gap = random_bytes(65536, 7);
  std::fill(gap.begin() + 30000, gap.begin() + 34096, std::byte{0});
  for (const Bytes* b : {&sweep, &repeated, &gap}) {
    EXPECT_FALSE(looks_incompressible(*b));
    auto packed = compress(kCompressionZlib, *b);
    ASSERT_TRUE(packed) << packed.status().to_string();
    ASSERT_FALSE(packed->empty());
    EXPECT_EQ(*packed, deflate_raw(*b));
  }
}

// Each worker thread has its own context: concurrent compression gives the
// same streams as one thread does.
TEST(Qcow2Compress, ThreadsCompressIndependently) {
  const Bytes plain = pattern(65536);
  const Bytes expect = deflate_raw(plain);
  std::vector<std::thread> threads;
  std::vector<int> same(4, 0);
  for (size_t t = 0; t < same.size(); ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < 20; ++i) {
        auto packed = compress(kCompressionZlib, plain);
        same[t] += packed && *packed == expect ? 1 : 0;
      }
    });
  for (auto& th : threads) th.join();
  for (int n : same) EXPECT_EQ(n, 20);
}

TEST(Qcow2Compress, ClusterCacheEvictsLeastRecentlyUsed) {
  ClusterCache cache(2);
  auto mk = [] { return std::make_shared<const io::AlignedBuffer>(512); };
  cache.insert(1, mk());
  cache.insert(2, mk());
  EXPECT_NE(cache.find(1), nullptr);  // 1 becomes most recent
  cache.insert(3, mk());              // evicts 2
  EXPECT_EQ(cache.size(), 2u);
  EXPECT_EQ(cache.find(2), nullptr);
  EXPECT_NE(cache.find(1), nullptr);
  EXPECT_NE(cache.find(3), nullptr);
  cache.erase(3);
  EXPECT_EQ(cache.find(3), nullptr);
  EXPECT_EQ(cache.size(), 1u);
}

}  // namespace
}  // namespace qcowfs::image::qcow2
