// ImageLock: QEMU-compatible lock bytes and conflict rules. OFD locks held on
// different open file descriptions conflict even inside one process, so two
// ImageLocks here behave like two processes.
#include "io/lock.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include <gtest/gtest.h>

namespace qcowfs::io {
namespace {

class ImageLockTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/var/tmp/qcowfs-lock-XXXXXX";
    int fd = ::mkstemp(tmpl);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::ftruncate(fd, 1 << 20), 0);
    ::close(fd);
    path_ = tmpl;
  }
  void TearDown() override { ::unlink(path_.c_str()); }

  Result<ImageLock> lock(bool writable, bool force_share = false, LockMode mode = LockMode::on) {
    return ImageLock::acquire(path_, LockPerms::for_image(writable, force_share), mode);
  }

  std::string path_;
};

TEST(LockPermsTest, MatchQemuForQcow2Files) {
  // qemu-storage-daemon with a qcow2 node: rw holds bytes 100,101,103 and 201,203; ro holds 100 and 201,203.
  LockPerms rw = LockPerms::for_image(true, false);
  EXPECT_EQ(rw.perms, kPermConsistentRead | kPermWrite | kPermResize);
  EXPECT_EQ(rw.shared, kPermConsistentRead | kPermWriteUnchanged);
  LockPerms ro = LockPerms::for_image(false, false);
  EXPECT_EQ(ro.perms, kPermConsistentRead);
  EXPECT_EQ(ro.shared, kPermConsistentRead | kPermWriteUnchanged);
  LockPerms u = LockPerms::for_image(false, true);
  EXPECT_EQ(u.perms, kPermConsistentRead);
  EXPECT_EQ(u.shared, kPermAll);
}

TEST(LockModeTest, ParsesQemuNames) {
  EXPECT_EQ(*parse_lock_mode("auto"), LockMode::automatic);
  EXPECT_EQ(*parse_lock_mode("on"), LockMode::on);
  EXPECT_EQ(*parse_lock_mode("off"), LockMode::off);
  auto bad = parse_lock_mode("yes");
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.status().code(), EINVAL);
  EXPECT_EQ(to_string(LockMode::automatic), "auto");
}

TEST_F(ImageLockTest, WriterTakesQemuBytes) {
  auto w = lock(true);
  ASSERT_TRUE(w) << w.status().to_string();
  EXPECT_TRUE(w->held());
  auto bytes = probe_lock_bytes(path_);
  ASSERT_TRUE(bytes) << bytes.status().to_string();
  EXPECT_EQ(bytes->perms, kPermConsistentRead | kPermWrite | kPermResize);
  EXPECT_EQ(bytes->shared, kPermWrite | kPermResize);
}

TEST_F(ImageLockTest, ReadersShare) {
  auto a = lock(false);
  ASSERT_TRUE(a) << a.status().to_string();
  auto b = lock(false);
  ASSERT_TRUE(b) << b.status().to_string();
  auto bytes = probe_lock_bytes(path_);
  ASSERT_TRUE(bytes);
  EXPECT_EQ(bytes->perms, kPermConsistentRead);
  EXPECT_EQ(bytes->shared, kPermWrite | kPermResize);
}

TEST_F(ImageLockTest, WriterRefusedWhileReaderHolds) {
  auto r = lock(false);
  ASSERT_TRUE(r);
  auto w = lock(true);
  ASSERT_FALSE(w);
  EXPECT_EQ(w.status().code(), EBUSY);
  EXPECT_NE(w.status().message().find("\"write\" lock"), std::string::npos) << w.status().message();
}

TEST_F(ImageLockTest, ReaderRefusedWhileWriterHolds) {
  auto w = lock(true);
  ASSERT_TRUE(w);
  auto r = lock(false);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.status().code(), EBUSY);
  EXPECT_NE(r.status().message().find("shared \"write\" lock"), std::string::npos) << r.status().message();
}

TEST_F(ImageLockTest, TwoWritersRefuseEachOther) {
  auto a = lock(true);
  ASSERT_TRUE(a);
  auto b = lock(true);
  ASSERT_FALSE(b);
  EXPECT_EQ(b.status().code(), EBUSY);
}

TEST_F(ImageLockTest, ForceShareReaderCoexistsWithWriter) {
  auto w = lock(true);
  ASSERT_TRUE(w);
  auto u = lock(false, true);
  ASSERT_TRUE(u) << u.status().to_string();
  // And the other way round: a writer may start while a force-share reader holds.
  w = ImageLock();
  auto w2 = lock(true);
  EXPECT_TRUE(w2) << w2.status().to_string();
}

TEST_F(ImageLockTest, ForceShareNeedsReadOnly) {
  auto bad = lock(true, true);
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.status().code(), EINVAL);
  EXPECT_NE(bad.status().message().find("force-share"), std::string::npos);
}

TEST_F(ImageLockTest, ReleasedOnDestruction) {
  {
    auto w = lock(true);
    ASSERT_TRUE(w);
  }
  auto bytes = probe_lock_bytes(path_);
  ASSERT_TRUE(bytes);
  EXPECT_EQ(bytes->perms, 0u);
  EXPECT_EQ(bytes->shared, 0u);
  EXPECT_TRUE(lock(true));
}

TEST_F(ImageLockTest, MovedLockStaysHeld) {
  auto w = lock(true);
  ASSERT_TRUE(w);
  ImageLock moved = std::move(*w);
  EXPECT_TRUE(moved.held());
  EXPECT_FALSE(lock(false));
}

TEST_F(ImageLockTest, LockingOffTakesNothingAndChecksNothing) {
  auto w = lock(true);
  ASSERT_TRUE(w);
  auto off = lock(true, false, LockMode::off);
  ASSERT_TRUE(off) << off.status().to_string();
  EXPECT_FALSE(off->held());
  auto bytes = probe_lock_bytes(path_);
  ASSERT_TRUE(bytes);
  EXPECT_EQ(bytes->perms, kPermConsistentRead | kPermWrite | kPermResize);
}

TEST_F(ImageLockTest, MissingFileIsAnError) {
  auto r = ImageLock::acquire(path_ + ".missing", LockPerms::for_image(false, false), LockMode::automatic);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.status().code(), ENOENT);
}

}  // namespace
}  // namespace qcowfs::io
