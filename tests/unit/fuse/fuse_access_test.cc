#include <gtest/gtest.h>

#include <sys/stat.h>

#include <atomic>
#include <memory>
#include <thread>

#include "unit/image/fake_driver.h"
#include "fuse/access.h"
#include "fuse/filesystem.h"
#include "fuse/image_file.h"
#include "fuse/inode_table.h"

namespace qcowfs::fuse {
namespace {

struct stat image_stat(uid_t uid, gid_t gid, mode_t mode) {
  struct stat st = {};
  st.st_uid = uid;
  st.st_gid = gid;
  st.st_mode = S_IFREG | mode;
  return st;
}

mode_t perms(const struct stat& st) { return st.st_mode & 07777; }

TEST(FuseAccess, ViewFollowsTheImageFile) {
  ViewAttrs a = initial_view_attrs(image_stat(0, 6, 0600), {});
  EXPECT_EQ(a.uid, 0u);
  EXPECT_EQ(a.gid, 6u);
  EXPECT_EQ(a.mode, 0600u);
  // Execute and set-id bits of the image file never reach the view.
  EXPECT_EQ(initial_view_attrs(image_stat(1000, 1000, 04755), {}).mode, 0644u);
  EXPECT_EQ(initial_view_attrs(image_stat(0, 6, 0660), {}).mode, 0660u);  // a block device: root:disk 0660
}

TEST(FuseAccess, OptionsReplaceOwnerAndBits) {
  AccessOptions o;
  o.uid = 1234;
  o.gid = 99;
  o.fmask = 077;
  ViewAttrs a = initial_view_attrs(image_stat(0, 0, 0644), o);
  EXPECT_EQ(a.uid, 1234u);
  EXPECT_EQ(a.gid, 99u);
  EXPECT_EQ(a.mode, 0600u);
  o.fmask = 0;  // umask=0 grants what the image file does not: the administrator's choice
  EXPECT_EQ(initial_view_attrs(image_stat(0, 0, 0600), o).mode, 0666u);
  AccessOptions only_gid;
  only_gid.gid = 5;
  ViewAttrs g = initial_view_attrs(image_stat(7, 8, 0640), only_gid);
  EXPECT_EQ(g.uid, 7u);
  EXPECT_EQ(g.gid, 5u);
  EXPECT_EQ(g.mode, 0640u);
}

TEST(FuseAccess, ReadOnlyFilesLoseWriteBits) {
  EXPECT_EQ(file_permissions(0664, true), 0664u);
  EXPECT_EQ(file_permissions(0664, false), 0444u);
  EXPECT_EQ(file_permissions(0600, false), 0400u);
  EXPECT_EQ(file_permissions(0200, false), 0u);
}

TEST(FuseAccess, DirectoriesOpenToWhoeverMayReadTheView) {
  EXPECT_EQ(directory_permissions(0600, 0), 0500u);
  EXPECT_EQ(directory_permissions(0640, 0), 0550u);
  EXPECT_EQ(directory_permissions(0644, 0), 0555u);
  EXPECT_EQ(directory_permissions(0666, 0), 0555u);  // never writable
  EXPECT_EQ(directory_permissions(0200, 0), 0u);     // write-only view: nothing to list
  EXPECT_EQ(directory_permissions(0644, 027), 0550u);
  EXPECT_EQ(directory_permissions(0644, 0777), 0u);
}

TEST(FuseAccess, OnlyTheMounterAndRootMayChange) {
  EXPECT_TRUE(may_change_access(0, 1000));
  EXPECT_TRUE(may_change_access(1000, 1000));
  EXPECT_FALSE(may_change_access(1001, 1000));
  EXPECT_TRUE(may_change_access(0, 0));
  EXPECT_FALSE(may_change_access(1000, 0));
}

TEST(FuseAccess, ChangeAppliesAllFieldsAndCutsTheMode) {
  ViewAccess v(ViewAttrs{0, 0, 0600});
  AccessChange c;
  c.mode = S_IFREG | 04755;
  v.change(c);
  EXPECT_EQ(v.get().mode, 0644u);
  EXPECT_EQ(v.get().uid, 0u);
  AccessChange owner;
  owner.uid = 42;
  owner.gid = 43;
  v.change(owner);
  EXPECT_EQ(v.get().uid, 42u);
  EXPECT_EQ(v.get().gid, 43u);
  EXPECT_EQ(v.get().mode, 0644u);
}

TEST(FuseAccess, ConcurrentReadersSeeWholeChanges) {
  ViewAccess v(ViewAttrs{1, 1, 0600});
  std::atomic<bool> torn{false};
  std::thread reader([&] {
    for (int i = 0; i < 20000; ++i) {
      ViewAttrs a = v.get();
      if (a.uid != a.gid) torn = true;
    }
  });
  for (uid_t i = 2; i < 20000; ++i) {
    AccessChange c;
    c.uid = i;
    c.gid = i;
    v.change(c);
  }
  reader.join();
  EXPECT_FALSE(torn.load());
}

// A directory-mode tree: disk.raw (the view), snapshots/s.raw, and a
// read-only copy standing in for a partition of a read-only mount.
struct Tree {
  fakes::FakeDriver disk{1 << 20, false};
  InodeTable table = InodeTable::directory_root();
  Ino view = 0, snaps = 0, snap = 0, ro_file = 0;
  Tree(bool writable) {
    view = table.add_image(kRootIno, "disk.raw", std::make_unique<ImageFile>(&disk, writable));
    snaps = table.add_directory(kRootIno, "snapshots");
    snap = table.add_image(snaps, "s.raw", std::make_unique<ImageFile>(&disk, "1", 4096));
    ro_file = table.add_image(kRootIno, "ro.raw", std::make_unique<ImageFile>(&disk, false));
  }
};

AttrContext context(uid_t uid, gid_t gid, mode_t mode, mode_t dmask = 0) {
  AttrContext c;
  c.view = ViewAttrs{uid, gid, mode};
  c.dir_mask = dmask;
  return c;
}

TEST(FuseAccess, EveryNodeFollowsTheView) {
  Tree t(true);
  AttrContext ctx = context(0, 6, 0660);
  struct stat view = t.table.attributes(*t.table.get(t.view), ctx);
  EXPECT_EQ(perms(view), 0660u);
  EXPECT_EQ(view.st_uid, 0u);
  EXPECT_EQ(view.st_gid, 6u);
  EXPECT_EQ(perms(t.table.attributes(*t.table.get(t.snap), ctx)), 0440u);  // snapshots: never writable
  EXPECT_EQ(perms(t.table.attributes(*t.table.get(t.ro_file), ctx)), 0440u);
  struct stat root = t.table.attributes(*t.table.get(kRootIno), ctx);
  EXPECT_EQ(perms(root), 0550u);
  EXPECT_EQ(root.st_gid, 6u);
  EXPECT_EQ(perms(t.table.attributes(*t.table.get(t.snaps), ctx)), 0550u);
  EXPECT_EQ(perms(t.table.attributes(*t.table.get(t.snaps), context(0, 6, 0660, 007))), 0550u);
  EXPECT_EQ(perms(t.table.attributes(*t.table.get(t.snaps), context(0, 6, 0660, 070))), 0500u);
}

TEST(FuseAccess, ReadOnlyMountShowsNoWriteBits) {
  Tree t(false);
  AttrContext ctx = context(1000, 1000, 0666);
  EXPECT_EQ(perms(t.table.attributes(*t.table.get(t.view), ctx)), 0444u);
}

TEST(FuseAccess, ChmodAndChownChangeTheViewForEveryNode) {
  Tree t(true);
  Ino view = t.view, snap = t.snap, snaps = t.snaps;
  Filesystem fs(std::move(t.table), context(0, 0, 0600), view, 1000);
  AccessChange chmod;
  chmod.mode = 0644;
  ASSERT_TRUE(fs.change_access(view, 1000, chmod));  // the mounting user
  AttrContext now = fs.attr_context();
  EXPECT_EQ(now.view.mode, 0644u);
  EXPECT_EQ(perms(fs.table().attributes(*fs.table().get(view), now)), 0644u);
  EXPECT_EQ(perms(fs.table().attributes(*fs.table().get(snap), now)), 0444u);
  EXPECT_EQ(perms(fs.table().attributes(*fs.table().get(snaps), now)), 0555u);
  AccessChange chown;
  chown.uid = 4242;
  ASSERT_TRUE(fs.change_access(view, 0, chown));  // root
  EXPECT_EQ(fs.attr_context().view.uid, 4242u);
  EXPECT_EQ(fs.table().attributes(*fs.table().get(snap), fs.attr_context()).st_uid, 4242u);
}

TEST(FuseAccess, OthersAndOtherNodesGetEperm) {
  Tree t(true);
  Ino view = t.view, snap = t.snap, snaps = t.snaps;
  Filesystem fs(std::move(t.table), context(0, 0, 0600), view, 1000);
  AccessChange c;
  c.mode = 0666;
  EXPECT_EQ(fs.change_access(view, 4242, c).code(), EPERM);  // the view's owner by chown, say: not enough
  EXPECT_EQ(fs.change_access(snap, 0, c).code(), EPERM);
  EXPECT_EQ(fs.change_access(snaps, 0, c).code(), EPERM);
  EXPECT_EQ(fs.change_access(kRootIno, 1000, c).code(), EPERM);
  EXPECT_EQ(fs.attr_context().view.mode, 0600u);
}

}  // namespace
}  // namespace qcowfs::fuse
