// PartitionDirectory (DIR/partitions/) and its place in the InodeTable:
// refresh, lookup, stable inodes, nodes kept alive across repartitioning.
#include <gtest/gtest.h>

#include "fuse/partitions_dir.h"
#include "image/raw/raw.h"
#include "io/mem_file.h"
#include "unit/io/io_test_util.h"

namespace qcowfs::fuse {
namespace {

using io::testing::run_now;
using Bytes = std::vector<std::byte>;

void mbr_entry(io::MemFile& f, int i, uint8_t type, uint32_t lba, uint32_t sectors) {
  Bytes s(512);
  auto n = run_now(f.read(0, s));
  ASSERT_TRUE(n.is_ok());
  size_t e = 446 + static_cast<size_t>(i) * 16;
  s[e + 4] = std::byte{type};
  for (int b = 0; b < 4; ++b) {
    s[e + 8 + static_cast<size_t>(b)] = static_cast<std::byte>(lba >> (8 * b));
    s[e + 12 + static_cast<size_t>(b)] = static_cast<std::byte>(sectors >> (8 * b));
  }
  s[510] = std::byte{0x55};
  s[511] = std::byte{0xaa};
  ASSERT_TRUE(run_now(f.write(0, s)).is_ok());
}

struct Fixture {
  io::MemFile file{io::MemFileOptions{}, Bytes(4 << 20)};
  image::RawDriver disk{&file, false};
  InodeTable table = InodeTable::directory_root();
  Ino dir = table.add_directory(kRootIno, "partitions");
  PartitionDirectory* parts = nullptr;

  Fixture() {
    auto d = std::make_unique<PartitionDirectory>(dir, &disk, true);
    parts = d.get();
    table.set_dynamic(std::move(d));
  }
};

TEST(PartitionDirectory, EmptyUntilATableAppears) {
  Fixture f;
  ASSERT_TRUE(run_now(f.parts->refresh(f.dir)).is_ok());
  EXPECT_TRUE(f.table.children(*f.table.get(f.dir)).empty());
  mbr_entry(f.file, 0, 0x83, 2048, 2048);
  mbr_entry(f.file, 1, 0x0c, 4096, 2048);
  EXPECT_EQ(f.table.lookup(f.dir, "p1.raw"), nullptr) << "nothing changes before a refresh";
  ASSERT_TRUE(run_now(f.parts->refresh(f.dir)).is_ok());
  auto kids = f.table.children(*f.table.get(f.dir));
  ASSERT_EQ(kids.size(), 2u);
  const Node* p1 = f.table.lookup(f.dir, "p1.raw");
  ASSERT_NE(p1, nullptr);
  EXPECT_EQ(f.table.get(p1->ino), p1);
  EXPECT_EQ(p1->parent, f.dir);
  EXPECT_EQ(p1->kind, NodeKind::image);
  EXPECT_EQ(p1->file->size(), 2048u * 512);
  EXPECT_TRUE(p1->file->writable());
  EXPECT_GE(p1->ino, kPartitionInoBase);
  EXPECT_EQ(f.table.dynamic_for(f.dir), f.parts);
  EXPECT_EQ(f.table.dynamic_for(kRootIno), nullptr);
}

TEST(PartitionDirectory, UnchangedPartitionsKeepTheirInode) {
  Fixture f;
  mbr_entry(f.file, 0, 0x83, 2048, 2048);
  mbr_entry(f.file, 1, 0x83, 4096, 2048);
  ASSERT_TRUE(run_now(f.parts->refresh(f.dir)).is_ok());
  Ino p1 = f.table.lookup(f.dir, "p1.raw")->ino;
  const Node* old_p2 = f.table.lookup(f.dir, "p2.raw");
  mbr_entry(f.file, 1, 0x83, 4096, 1024);  // p2 shrinks
  ASSERT_TRUE(run_now(f.parts->refresh(f.dir)).is_ok());
  EXPECT_EQ(f.table.lookup(f.dir, "p1.raw")->ino, p1);
  const Node* new_p2 = f.table.lookup(f.dir, "p2.raw");
  EXPECT_NE(new_p2->ino, old_p2->ino);
  EXPECT_EQ(new_p2->file->size(), 1024u * 512);
  // The dropped node stays valid for requests still holding it.
  EXPECT_EQ(f.table.get(old_p2->ino), old_p2);
  EXPECT_EQ(old_p2->file->size(), 2048u * 512);
  EXPECT_EQ(f.table.image_files().size(), 3u);
}

TEST(PartitionDirectory, WritesGoThroughTheWindow) {
  Fixture f;
  mbr_entry(f.file, 0, 0x83, 2048, 2048);
  ASSERT_TRUE(run_now(f.parts->refresh(f.dir)).is_ok());
  image::BlockDriver* d = f.table.lookup(f.dir, "p1.raw")->file->driver();
  ASSERT_NE(d, nullptr);
  Bytes data(512, std::byte{0x7e});
  ASSERT_TRUE(run_now(d->write(512, data)).is_ok());
  EXPECT_EQ(f.file.content()[2048 * 512 + 512], std::byte{0x7e});
}

}  // namespace
}  // namespace qcowfs::fuse
