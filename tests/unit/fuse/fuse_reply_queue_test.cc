#include <gtest/gtest.h>
#include <linux/fuse.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "fuse/reply_queue.h"
#include "io/fd.h"
#include "io/uring_engine.h"

namespace qcowfs::fuse {
namespace {

struct Pair {
  io::UniqueFd ours, theirs;  // a datagram socket pair: one reply per read
};

Pair socket_pair() {
  int fds[2];
  EXPECT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, fds), 0);
  return {io::UniqueFd(fds[0]), io::UniqueFd(fds[1])};
}

std::vector<std::byte> reply_bytes(uint64_t unique, size_t data) {
  std::vector<std::byte> msg(sizeof(fuse_out_header) + data);
  fuse_out_header out = {};
  out.len = static_cast<uint32_t>(msg.size());
  out.unique = unique;
  std::memcpy(msg.data(), &out, sizeof out);
  for (size_t i = sizeof out; i < msg.size(); ++i) msg[i] = std::byte(i * 13);
  return msg;
}

// Two iovecs, as libfuse sends them: the header, then the argument or data.
std::optional<ssize_t> queue(ReplyQueue& q, io::Engine& e, int fd, std::vector<std::byte>& msg) {
  iovec iov[2] = {{msg.data(), sizeof(fuse_out_header)},
                  {msg.data() + sizeof(fuse_out_header), msg.size() - sizeof(fuse_out_header)}};
  return q.queue(e, fd, iov, 2);
}

std::vector<std::byte> receive(int fd) {
  std::vector<std::byte> got(2 * kQueuedReplyMax);
  ssize_t n = ::read(fd, got.data(), got.size());
  got.resize(n < 0 ? 0 : static_cast<size_t>(n));
  return got;
}

// Each test runs the queue on an io_uring engine of its own thread.
class FuseReplyQueue : public ::testing::Test {
 protected:
  void SetUp() override {
    auto engine = io::UringEngine::create(16);
    ASSERT_TRUE(engine) << engine.status().to_string();
    engine_ = std::move(*engine);
    scope_.emplace(engine_.get());
  }
  void drain(const ReplyQueue& q) {
    while (q.pending() > 0) engine_->run_once(1000);
  }
  std::unique_ptr<io::UringEngine> engine_;
  std::optional<io::ScopedEngine> scope_;
};

TEST_F(FuseReplyQueue, ShortRepliesLeaveWithTheEnginesNextSubmit) {
  Pair p = socket_pair();
  ReplyQueue q;
  auto write_reply = reply_bytes(7, sizeof(fuse_write_out));
  auto read_reply = reply_bytes(8, 4096);  // the largest one queued
  ASSERT_EQ(queue(q, *engine_, p.ours.get(), write_reply), std::optional<ssize_t>(write_reply.size()));
  ASSERT_EQ(queue(q, *engine_, p.ours.get(), read_reply), std::optional<ssize_t>(read_reply.size()));
  // The caller's bytes are copied: it may reuse them at once.
  std::vector<std::byte> sent_write = write_reply;
  std::memset(write_reply.data(), 0, write_reply.size());
  EXPECT_EQ(q.pending(), 2u);
  EXPECT_TRUE(receive(p.theirs.get()).empty());  // nothing written before the engine submits
  drain(q);
  EXPECT_EQ(receive(p.theirs.get()), sent_write);
  EXPECT_EQ(receive(p.theirs.get()), read_reply);
  EXPECT_TRUE(q.queuing());
}

TEST_F(FuseReplyQueue, LargeRepliesAndNotificationsAreWrittenByTheCaller) {
  Pair p = socket_pair();
  ReplyQueue q;
  auto large = reply_bytes(9, kQueuedReplyMax - sizeof(fuse_out_header) + 1);
  auto notification = reply_bytes(0, 8);
  EXPECT_EQ(queue(q, *engine_, p.ours.get(), large), std::nullopt);
  EXPECT_EQ(queue(q, *engine_, p.ours.get(), notification), std::nullopt);
  EXPECT_EQ(q.pending(), 0u);
}

// A READ reply whose data buffer is lent has only its header copied: the
// queue holds the buffer until the write completes, and the bytes that leave
// are the buffer's at submit time.
TEST_F(FuseReplyQueue, ALentReadBufferIsSentWithoutACopy) {
  Pair p = socket_pair();
  ReplyQueue q;
  const size_t data = kQueuedReplyMax - sizeof(fuse_out_header);
  auto expected = reply_bytes(11, data);
  fuse_out_header out;
  std::memcpy(&out, expected.data(), sizeof out);
  PooledBuffer lent(nullptr, io::AlignedBuffer(data, 4096, true));
  std::byte* bytes = lent.data();
  std::memcpy(bytes, expected.data() + sizeof out, data);
  bytes[0] = std::byte{0};  // changed after queue(), before the engine submits
  iovec iov[2] = {{&out, sizeof out}, {bytes, data}};
  ASSERT_EQ(q.queue(*engine_, p.ours.get(), iov, 2, &lent), std::optional<ssize_t>(sizeof out + data));
  EXPECT_EQ(lent.data(), nullptr);  // the queue owns the buffer now
  out.unique = 99;                  // the header was copied
  bytes[0] = expected[sizeof out];
  std::vector<std::byte> got(2 * expected.size());
  drain(q);
  ssize_t n = ::read(p.theirs.get(), got.data(), got.size());
  got.resize(n < 0 ? 0 : static_cast<size_t>(n));
  EXPECT_EQ(got, expected);

  // Data that is not the lent buffer's start is copied as before; a large
  // reply is left to the caller, lent or not.
  PooledBuffer other(nullptr, io::AlignedBuffer(2 * kQueuedReplyMax, 4096, true));
  auto small = reply_bytes(12, 64);
  iovec iov2[2] = {{small.data(), sizeof out}, {small.data() + sizeof out, 64}};
  ASSERT_EQ(q.queue(*engine_, p.ours.get(), iov2, 2, &other), std::optional<ssize_t>(small.size()));
  EXPECT_NE(other.data(), nullptr);
  iovec iov3[2] = {{&out, sizeof out}, {other.data(), kQueuedReplyMax}};
  EXPECT_EQ(q.queue(*engine_, p.ours.get(), iov3, 2, &other), std::nullopt);
  EXPECT_NE(other.data(), nullptr);
  drain(q);
  EXPECT_EQ(receive(p.theirs.get()), small);
}

// A kernel that refuses a queued reply (here: a descriptor that cannot be
// written) gets no further ones: they go back to the caller's writev().
TEST_F(FuseReplyQueue, AFailedReplyStopsQueuing) {
  int pipefd[2];
  ASSERT_EQ(::pipe2(pipefd, O_CLOEXEC), 0);
  io::UniqueFd read_end(pipefd[0]), write_end(pipefd[1]);
  ReplyQueue q;
  auto reply = reply_bytes(5, 8);
  ASSERT_TRUE(queue(q, *engine_, read_end.get(), reply));  // EBADF once submitted
  drain(q);
  EXPECT_FALSE(q.queuing());
  EXPECT_EQ(queue(q, *engine_, write_end.get(), reply), std::nullopt);
}

}  // namespace
}  // namespace qcowfs::fuse
