// SnapshotDirectory (fuse/snapshots_dir.h): snapshots/ follows the driver's
// snapshot table at each refresh, keeps a snapshot's inode while it lasts and
// its node after, and release_view() refuses a held view and closes an unused one.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "fuse/snapshots_dir.h"
#include "io/run_sync.h"
#include "unit/image/fake_driver.h"

namespace qcowfs::fuse {
namespace {

using fakes::FakeDriver;

image::SnapshotInfo snapshot_info(std::string id, std::string name, uint64_t size) {
  image::SnapshotInfo s;
  s.id = std::move(id);
  s.name = std::move(name);
  s.disk_size = size;
  return s;
}

std::vector<std::string> names(const InodeTable& table, Ino dir) {
  std::vector<std::string> out;
  for (Ino i : table.children(*table.get(dir))) out.push_back(table.get(i)->name);
  return out;
}

TEST(FuseSnapshotDirectory, FollowsTheSnapshotTableAndReleasesViews) {
  auto engine = io::make_engine(io::EngineKind::threads);
  ASSERT_TRUE(engine) << engine.status().to_string();
  FakeDriver disk(1 << 20, false, {snapshot_info("1", "a", 65536)});
  InodeTable table = InodeTable::directory_root();
  SnapshotDirectory* d = add_snapshot_directory(table, disk, false);
  ASSERT_NE(d, nullptr);
  const Ino dir = table.lookup(kRootIno, "snapshots")->ino;
  ASSERT_EQ(table.dynamic_for(dir), d);
  EXPECT_EQ(names(table, dir), std::vector<std::string>{"a.raw"});
  const Node* a = table.lookup(dir, "a.raw");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->file->size(), 65536u);
  EXPECT_EQ(disk.snapshot_opens.load(), 0);  // opened on first open only

  // A snapshot taken: shown after the next refresh, the old entry keeps its node.
  disk.set_snapshots({snapshot_info("1", "a", 65536), snapshot_info("2", "b", 4096)});
  ASSERT_TRUE(io::run_sync(**engine, d->refresh(dir)));
  EXPECT_EQ(names(table, dir), (std::vector<std::string>{"a.raw", "b.raw"}));
  EXPECT_EQ(table.lookup(dir, "a.raw"), a);

  // A held view refuses its release; given back, it is closed.
  ASSERT_TRUE(io::run_sync(**engine, a->file->acquire()));
  EXPECT_EQ(disk.snapshot_opens.load(), 1);
  EXPECT_EQ(io::run_sync(**engine, d->release_view("1")).code(), EBUSY);
  EXPECT_TRUE(a->file->is_open());
  a->file->release();
  ASSERT_TRUE(io::run_sync(**engine, d->release_view("1")));
  EXPECT_FALSE(a->file->is_open());
  EXPECT_TRUE(io::run_sync(**engine, d->release_view("2")));  // never opened: nothing to do

  // The snapshot deleted: gone from the listing, its node still valid.
  disk.set_snapshots({snapshot_info("2", "b", 4096)});
  ASSERT_TRUE(io::run_sync(**engine, d->refresh(dir)));
  EXPECT_EQ(names(table, dir), std::vector<std::string>{"b.raw"});
  EXPECT_EQ(table.lookup(dir, "a.raw"), nullptr);
  EXPECT_EQ(table.get(a->ino), a);
  // Its view now fails to open, with the driver's ENOENT.
  EXPECT_EQ(io::run_sync(**engine, a->file->acquire()).code(), ENOENT);
}

TEST(FuseSnapshotDirectory, ShownWithoutSnapshotsOnlyWhenTheyMayChange) {
  FakeDriver disk(1 << 20, false);
  InodeTable fixed = InodeTable::directory_root();
  EXPECT_EQ(add_snapshot_directory(fixed, disk, false), nullptr);
  EXPECT_EQ(fixed.lookup(kRootIno, "snapshots"), nullptr);
  InodeTable live = InodeTable::directory_root();
  ASSERT_NE(add_snapshot_directory(live, disk, true), nullptr);
  const Node* dir = live.lookup(kRootIno, "snapshots");
  ASSERT_NE(dir, nullptr);
  EXPECT_TRUE(names(live, dir->ino).empty());
}

}  // namespace
}  // namespace qcowfs::fuse
