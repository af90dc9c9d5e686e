#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "fuse/event_loop.h"
#include "fuse/request_buffer.h"
#include "io/align.h"

namespace qcowfs::fuse {
namespace {

TEST(FuseEventLoop, SmallWritePayloadsAreCopiedOutAligned) {
  EventLoop loop(EventLoop::Config{});
  std::vector<std::byte> request(kCopyWriteMax + 1);
  for (size_t i = 0; i < request.size(); ++i) request[i] = std::byte(i * 7);
  std::span<const std::byte> payload(request.data() + 1, 4096 + 3);  // unaligned, odd size
  PooledBuffer held = loop.hold_write_payload(payload);
  ASSERT_NE(payload.data(), request.data() + 1);
  EXPECT_EQ(payload.data(), held.data());
  EXPECT_EQ(payload.size(), 4096u + 3);
  EXPECT_TRUE(is_aligned_ptr(payload.data(), 4096));
  EXPECT_EQ(std::memcmp(payload.data(), request.data() + 1, payload.size()), 0);
  request[1] = std::byte{0xff};  // the request buffer may now be reused
  EXPECT_EQ(payload[0], std::byte(7));
}

TEST(FuseEventLoop, LargeWritePayloadsStayInPlace) {
  EventLoop loop(EventLoop::Config{});
  std::vector<std::byte> request(kCopyWriteMax + 1);
  std::span<const std::byte> payload(request.data(), request.size());
  PooledBuffer held = loop.hold_write_payload(payload);
  EXPECT_EQ(payload.data(), request.data());  // zero copy: the request buffer is kept instead
  EXPECT_EQ(payload.size(), request.size());
}

}  // namespace
}  // namespace qcowfs::fuse
