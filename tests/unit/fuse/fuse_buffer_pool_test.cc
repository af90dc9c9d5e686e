#include <gtest/gtest.h>

#include <vector>

#include "fuse/buffer_pool.h"
#include "fuse/request_buffer.h"
#include "io/align.h"

namespace qcowfs::fuse {
namespace {

TEST(FuseBufferPool, ReusesUpToTheIdleLimit) {
  BufferPool pool(8192, 4096, 2);
  auto a = pool.take();
  auto b = pool.take();
  auto c = pool.take();
  std::byte* pa = a.data();
  EXPECT_EQ(a.size(), 8192u);
  EXPECT_TRUE(is_aligned_ptr(a.data(), 4096));
  pool.give(std::move(a));
  pool.give(std::move(b));
  pool.give(std::move(c));  // over the limit: freed
  EXPECT_EQ(pool.idle_count(), 2u);
  auto d = pool.take();
  auto e = pool.take();
  EXPECT_TRUE(d.data() == pa || e.data() == pa);
  EXPECT_EQ(pool.idle_count(), 0u);
}

TEST(FuseBufferPool, RejectsForeignAndMovedFromBuffers) {
  BufferPool pool(8192, 4096, 4);
  pool.give(io::AlignedBuffer(4096));
  io::AlignedBuffer moved(8192);
  io::AlignedBuffer sink = std::move(moved);
  pool.give(std::move(moved));  // NOLINT: a moved-from buffer has no memory
  EXPECT_EQ(pool.idle_count(), 0u);
}

TEST(FuseSizedBufferPool, ClassesArePowersOfTwo) {
  EXPECT_EQ(SizedBufferPool::class_size(1), 4096u);
  EXPECT_EQ(SizedBufferPool::class_size(4096), 4096u);
  EXPECT_EQ(SizedBufferPool::class_size(4097), 8192u);
  EXPECT_EQ(SizedBufferPool::class_size(1 << 20), size_t{1} << 20);
}

TEST(FuseSizedBufferPool, TakeGivesAtLeastTheSizeAndRecycles) {
  SizedBufferPool pool(8192);
  auto a = pool.take(5000);
  EXPECT_EQ(a.size(), 8192u);
  EXPECT_TRUE(is_aligned_ptr(a.data(), 8192));
  std::byte* p = a.data();
  pool.give(std::move(a));
  EXPECT_EQ(pool.idle_count(), 1u);
  auto b = pool.take(7000);
  EXPECT_EQ(b.data(), p);
  auto big = pool.take((size_t{1} << 20) + 1);  // beyond the pooled classes
  EXPECT_GE(big.size(), (size_t{1} << 20) + 1);
  pool.give(std::move(big));
  EXPECT_EQ(pool.idle_count(), 0u);
}

TEST(FuseSizedBufferPool, IdleMemoryIsBoundedAcrossClasses) {
  SizedBufferPool pool(4096);
  const size_t mib = size_t{1} << 20;
  std::vector<io::AlignedBuffer> held;
  for (size_t i = 0; i < SizedBufferPool::kIdleBytes / mib + 3; ++i) held.push_back(pool.take(mib));
  for (auto& b : held) pool.give(std::move(b));
  EXPECT_EQ(pool.idle_count(), SizedBufferPool::kIdleBytes / mib);
  pool.give(io::AlignedBuffer(4096));  // the budget is spent: even a small buffer is freed
  EXPECT_EQ(pool.idle_count(), SizedBufferPool::kIdleBytes / mib);
  auto again = pool.take(mib);
  pool.give(pool.take(4096));  // one megabyte free again: small buffers fit
  EXPECT_EQ(pool.idle_count(), SizedBufferPool::kIdleBytes / mib);
}

TEST(FuseRequestBuffer, WritePayloadLandsAligned) {
  io::AlignedBuffer b(kRequestBufferSize, kPayloadAlign);
  std::byte* payload = request_read_start(b) + kWriteHeaderBytes;
  EXPECT_TRUE(is_aligned_ptr(payload, kPayloadAlign));
  EXPECT_GE(request_read_capacity(b), kMaxWrite + kWriteHeaderBytes);
}

}  // namespace
}  // namespace qcowfs::fuse
