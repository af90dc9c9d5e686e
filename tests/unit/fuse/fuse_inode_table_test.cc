#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "unit/image/fake_driver.h"
#include "fuse/image_file.h"
#include "fuse/inode_table.h"
#include "io/run_sync.h"

namespace qcowfs::fuse {
namespace {

using fakes::FakeDriver;

image::SnapshotInfo snap(std::string id, std::string name, uint64_t size) {
  image::SnapshotInfo s;
  s.id = std::move(id);
  s.name = std::move(name);
  s.disk_size = size;
  return s;
}

TEST(FuseInodeTable, FileModeRootIsTheImage) {
  FakeDriver d(1 << 20, false);
  auto t = InodeTable::file_root(std::make_unique<ImageFile>(&d, true));
  EXPECT_TRUE(t.root_is_file());
  const Node* root = t.get(kRootIno);
  ASSERT_NE(root, nullptr);
  AttrContext ctx;
  ctx.view.uid = 1234;
  ctx.view.gid = 99;
  struct stat st = t.attributes(*root, ctx);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(st.st_mode & 07777, 0644u);
  EXPECT_EQ(st.st_size, 1 << 20);
  EXPECT_EQ(st.st_blocks, 4);  // 3*512+1 bytes round up to 4 sectors
  EXPECT_EQ(st.st_uid, 1234u);
  EXPECT_EQ(st.st_gid, 99u);
  EXPECT_EQ(t.lookup(kRootIno, "anything"), nullptr);  // a file has no children
}

TEST(FuseInodeTable, ReadOnlyViewsAre0444) {
  FakeDriver d(4096, true);
  auto t = InodeTable::file_root(std::make_unique<ImageFile>(&d, false));
  EXPECT_EQ(t.attributes(*t.get(kRootIno), {}).st_mode & 07777, 0444u);
}

TEST(FuseInodeTable, DirectoryModeLookupAndNesting) {
  FakeDriver d(8192, false);
  auto t = InodeTable::directory_root();
  Ino view = t.add_image(kRootIno, "disk.raw", std::make_unique<ImageFile>(&d, true));
  Ino snaps = t.add_directory(kRootIno, "snapshots");
  Ino s1 = t.add_image(snaps, "s1.raw", std::make_unique<ImageFile>(&d, "1", 4096));
  EXPECT_FALSE(t.root_is_file());
  EXPECT_EQ(t.lookup(kRootIno, "disk.raw")->ino, view);
  EXPECT_EQ(t.lookup(kRootIno, "snapshots")->ino, snaps);
  EXPECT_EQ(t.lookup(snaps, "s1.raw")->ino, s1);
  EXPECT_EQ(t.lookup(kRootIno, "s1.raw"), nullptr);
  EXPECT_EQ(t.lookup(view, "x"), nullptr);
  EXPECT_EQ(t.get(s1)->parent, snaps);
  EXPECT_EQ(t.get(kRootIno)->parent, kRootIno);
  EXPECT_EQ(t.get(0), nullptr);
  EXPECT_EQ(t.get(s1 + 1), nullptr);
  EXPECT_EQ(t.image_files().size(), 2u);
  struct stat root = t.attributes(*t.get(kRootIno), {});
  EXPECT_TRUE(S_ISDIR(root.st_mode));
  EXPECT_EQ(root.st_nlink, 3u);  // ".", its entry in the parent, and snapshots/..
  struct stat s = t.attributes(*t.get(s1), {});
  EXPECT_EQ(s.st_size, 4096);  // recorded size, before the snapshot is opened
  EXPECT_EQ(s.st_mode & 07777, 0444u);
}

TEST(FuseInodeTable, RawViewName) {
  EXPECT_EQ(raw_view_name("/images/vm.qcow2"), "vm.raw");
  EXPECT_EQ(raw_view_name("vm.img"), "vm.raw");
  EXPECT_EQ(raw_view_name("/a/b/vm.raw"), "vm.raw");
  EXPECT_EQ(raw_view_name("appliance-disk1.vmdk"), "appliance-disk1.raw");
  EXPECT_EQ(raw_view_name("azure.vhd"), "azure.raw");
  EXPECT_EQ(raw_view_name("vm.vhdx"), "vm.raw");
  EXPECT_EQ(raw_view_name("vbox.vdi"), "vbox.raw");
  EXPECT_EQ(raw_view_name("secret.luks"), "secret.raw");
  EXPECT_EQ(raw_view_name("/a/disk"), "disk.raw");
  EXPECT_EQ(raw_view_name("/a/disk.iso"), "disk.iso.raw");  // not an image format suffix
  EXPECT_EQ(raw_view_name(".qcow2"), ".qcow2.raw");  // nothing left without the suffix
  EXPECT_EQ(raw_view_name("x.qcow2.img"), "x.qcow2.raw");
}

TEST(FuseInodeTable, SnapshotFileNames) {
  std::vector<std::string> taken;
  EXPECT_EQ(snapshot_file_name("before", "1", taken), "before.raw");
  taken.push_back("before.raw");
  EXPECT_EQ(snapshot_file_name("before", "2", taken), "snapshot-2.raw");
  EXPECT_EQ(snapshot_file_name("", "3", taken), "snapshot-3.raw");
  EXPECT_EQ(snapshot_file_name("a/b", "4", taken), "snapshot-4.raw");
  EXPECT_EQ(snapshot_file_name(std::string(300, 'x'), "5", taken), "snapshot-5.raw");
}

TEST(FuseImageFile, SnapshotOpensOnceAndCloses) {
  FakeDriver parent(1 << 20, false, {snap("7", "s", 65536)});
  ImageFile view(&parent, "7", 65536);
  EXPECT_EQ(view.driver(), nullptr);
  EXPECT_FALSE(view.writable());
  auto engine = io::make_engine(io::EngineKind::threads);
  ASSERT_TRUE(engine) << engine.status().to_string();
  ASSERT_TRUE(io::run_sync(**engine, view.ensure_open()));
  ASSERT_NE(view.driver(), nullptr);
  EXPECT_EQ(view.size(), 65536u);
  EXPECT_TRUE(view.driver()->read_only());
  ASSERT_TRUE(io::run_sync(**engine, view.ensure_open()));
  EXPECT_EQ(parent.snapshot_opens.load(), 1);
  ASSERT_TRUE(io::run_sync(**engine, view.close()));
  EXPECT_EQ(view.driver(), nullptr);
  EXPECT_EQ(parent.closes.load(), 0);  // the parent is closed by its owner
}

TEST(FuseImageFile, MissingSnapshotReportsTheError) {
  FakeDriver parent(1 << 20, false, {});
  ImageFile view(&parent, "42", 4096);
  auto engine = io::make_engine(io::EngineKind::threads);
  ASSERT_TRUE(engine);
  Status st = io::run_sync(**engine, view.ensure_open());
  EXPECT_EQ(st.code(), ENOENT);
  EXPECT_NE(st.message().find("42"), std::string::npos);
  EXPECT_EQ(view.driver(), nullptr);
}

}  // namespace
}  // namespace qcowfs::fuse
