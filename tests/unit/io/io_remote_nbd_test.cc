// NbdFile (io/remote/nbd_file.h) without an NBD server: how a large read is
// cut into commands in flight together, and an open that is bounded by
// remote-timeout when the server never speaks or hangs up at once. Reading
// from real servers (qemu-nbd, nbdkit) is tests/integration/test_remote.py's.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "io/fd.h"
#include "io/remote/nbd_file.h"

namespace qcowfs::io {
namespace {

constexpr size_t KiB = 1024, MiB = 1024 * KiB;
constexpr size_t kMax = 32 * MiB;

TEST(NbdSplitRead, SmallReadsAreOneCommand) {
  EXPECT_EQ(split_read(4 * KiB, 256 * KiB, kMax), (std::vector<ReadPiece>{{0, 4 * KiB}}));
  EXPECT_EQ(split_read(511 * KiB, 256 * KiB, kMax), (std::vector<ReadPiece>{{0, 511 * KiB}}));
}

TEST(NbdSplitRead, AMegabyteIsFourPiecesInFlight) {
  EXPECT_EQ(split_read(MiB, 256 * KiB, kMax),
            (std::vector<ReadPiece>{{0, 256 * KiB}, {256 * KiB, 256 * KiB}, {512 * KiB, 256 * KiB}, {768 * KiB, 256 * KiB}}));
  // The last piece is shorter.
  EXPECT_EQ(split_read(600 * KiB, 256 * KiB, kMax),
            (std::vector<ReadPiece>{{0, 256 * KiB}, {256 * KiB, 256 * KiB}, {512 * KiB, 88 * KiB}}));
}

TEST(NbdSplitRead, LargeReadsAreAtMostSixteenPiecesEachAtMostTheServersLimit) {
  auto p = split_read(8 * MiB, 256 * KiB, kMax);
  ASSERT_EQ(p.size(), 16u);
  for (size_t i = 0; i < p.size(); ++i) EXPECT_EQ(p[i], (ReadPiece{i * 512 * KiB, 512 * KiB}));
  p = split_read(1024 * MiB, 256 * KiB, kMax);
  ASSERT_EQ(p.size(), 32u);  // 64 MiB pieces would pass the 32 MiB limit
  for (const auto& x : p) EXPECT_EQ(x.length, kMax);
  // Sizes not a multiple of 4 KiB: pieces stay 4 KiB multiples and cover n exactly.
  p = split_read(3 * MiB + 5, 256 * KiB, kMax);
  size_t covered = 0;
  for (const auto& x : p) {
    EXPECT_EQ(x.offset, covered);
    covered += x.length;
  }
  EXPECT_EQ(covered, 3 * MiB + 5);
  EXPECT_EQ(p.front().length % (4 * KiB), 0u);
}

// A TCP listener on 127.0.0.1 (any port): connections complete in the kernel's
// backlog whether or not anyone accepts them.
struct Listener {
  UniqueFd fd;
  int port = 0;
  Listener() {
    fd.reset(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), len) != 0 || ::listen(fd.get(), 4) != 0 ||
        ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&a), &len) != 0)
      return;
    port = ntohs(a.sin_port);
  }
  std::string uri() const { return "nbd://127.0.0.1:" + std::to_string(port) + "/exp"; }
};

OpenOptions with_timeout_ms(unsigned ms) {
  OpenOptions o;
  o.remote.timeout_ms = ms;
  o.remote.set_by_user = true;  // QCOWFS_REMOTE_OPTIONS of the environment left out
  return o;
}

// libnbd's blocking connect waited forever for a server that never sends its
// greeting; the open's handshake is bounded by remote-timeout (1 s here).
TEST(NbdOpen, AServerThatNeverSpeaksFailsAfterTheTimeout) {
  Listener l;
  ASSERT_NE(l.port, 0);
  auto f = NbdFile::open(l.uri(), with_timeout_ms(1000));
  ASSERT_FALSE(f);
  EXPECT_EQ(f.status().code(), EIO);
  EXPECT_NE(f.status().to_string().find("no answer within the timeout"), std::string::npos) << f.status().to_string();
}

TEST(NbdOpen, AServerThatHangsUpFailsWithLibnbdsReason) {
  Listener l;
  ASSERT_NE(l.port, 0);
  std::thread closer([&] {
    int c = ::accept4(l.fd.get(), nullptr, nullptr, SOCK_CLOEXEC);
    if (c >= 0) ::close(c);
  });
  auto f = NbdFile::open(l.uri(), with_timeout_ms(30000));
  closer.join();
  ASSERT_FALSE(f);
  EXPECT_EQ(f.status().to_string().find("no answer within the timeout"), std::string::npos) << f.status().to_string();
}

}  // namespace
}  // namespace qcowfs::io
