#include <gtest/gtest.h>

#include <cstring>
#include <thread>
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

// While large WRITEs keep request buffers, a loop's chains past the first
// kLargeIoChains stop waiting once they and the kept buffers reach
// kReadChains, so a fill does not fault in a buffer per chain besides one per
// WRITE; the first chains always wait, so the loop never stops reading.
TEST(FuseEventLoop, ChainsPastTheFirstRestWhileWritesKeepBuffers) {
  static_assert(kLargeIoChains >= 1 && kLargeIoChains < kReadChains);
  for (size_t i = 0; i < kReadChains; ++i) EXPECT_FALSE(EventLoop::chain_rests(i, 0, kReadChains - 1)) << i;
  for (size_t i = 0; i < kLargeIoChains; ++i) EXPECT_FALSE(EventLoop::chain_rests(i, 64, kReadChains)) << i;
  for (size_t i = kLargeIoChains; i < kReadChains; ++i) {
    EXPECT_TRUE(EventLoop::chain_rests(i, kReadChains - kLargeIoChains, kLargeIoChains)) << i;
    EXPECT_TRUE(EventLoop::chain_rests(i, 64, 0)) << i;
    EXPECT_FALSE(EventLoop::chain_rests(i, kReadChains - kLargeIoChains - 1, kLargeIoChains)) << i;
  }
}

// Helpers may sleep only while loop 0's requests and their own are one or
// none; loop 0 stores just the level (0, 1, 2+) and only when it changes, so
// every change of level must still be seen, and counts above two must read as
// two. Two or more needs kHelperBytes of data in flight too.
TEST(FuseReaderGroup, HelpersSeeTheLevelOfLoopZerosRequests) {
  ReaderGroup group(2);  // no loop registered: nothing to wake
  EXPECT_TRUE(group.quiet(0));
  EXPECT_TRUE(group.quiet(1));
  EXPECT_FALSE(group.quiet(2));
  struct Step {
    size_t first_inflight;
    uint64_t bytes;       // their READ and WRITE data
    bool quiet_idle;      // quiet(0): a helper with nothing in flight
    bool quiet_one_own;   // quiet(1)
  };
  constexpr uint64_t kBig = kHelperBytes;
  const Step steps[] = {
      {1, kBig, true, false}, {7, 8 * kBig, false, false}, {3, kBig, false, false},  // 3: still two or more
      {1, kBig, true, false}, {0, 0, true, true},          {2, kBig, false, false},
      // Many small requests: level 1, the helpers may sleep (one loop serves them).
      {32, 32 * 4096, true, false}, {2, kBig - 1, true, false}, {2, kBig, false, false},
  };
  for (const Step& step : steps) {
    group.set_first_inflight(step.first_inflight, step.bytes);
    EXPECT_EQ(group.quiet(0), step.quiet_idle) << "loop 0 at " << step.first_inflight << ", " << step.bytes;
    EXPECT_EQ(group.quiet(1), step.quiet_one_own) << "loop 0 at " << step.first_inflight << ", " << step.bytes;
  }
}

// A request buffer given back by one loop is the next one any loop takes
// (no new huge page), from any thread; it is a full request buffer.
TEST(FuseReaderGroup, LoopsShareRequestBuffers) {
  ReaderGroup group(2);
  io::AlignedBuffer a = group.take_request_buffer();
  ASSERT_NE(a.data(), nullptr);
  EXPECT_EQ(a.size(), kRequestBufferSize);
  EXPECT_TRUE(is_aligned_ptr(a.data(), kPayloadAlign));
  std::byte* const first = a.data();
  std::thread([&] { group.give_request_buffer(std::move(a)); }).join();
  io::AlignedBuffer b = group.take_request_buffer();
  EXPECT_EQ(b.data(), first);
  io::AlignedBuffer c = group.take_request_buffer();  // none idle: a new one
  EXPECT_NE(c.data(), first);
  group.give_request_buffer(io::AlignedBuffer(4096));  // not a request buffer: dropped
  io::AlignedBuffer d = group.take_request_buffer();
  EXPECT_EQ(d.size(), kRequestBufferSize);
}

}  // namespace
}  // namespace qcowfs::fuse
