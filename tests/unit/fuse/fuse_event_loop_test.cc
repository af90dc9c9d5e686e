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

}  // namespace
}  // namespace qcowfs::fuse
