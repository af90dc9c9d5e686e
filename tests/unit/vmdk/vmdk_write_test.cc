// The VMDK writer's own rules (image/vmdk/writer.h): the CID edit QEMU makes
// on a first write, the redundant grain table kept equal to the grain table,
// and the read-write refusals that protect data in use. The write path it
// shares with the other table formats is tested in image_extent_write_test.cc.
#include <gtest/gtest.h>

#include "image/endian.h"
#include "image/vmdk/descriptor.h"
#include "image/vmdk/format.h"
#include "image/vmdk/vmdk.h"
#include "io/mem_file.h"
#include "unit/qcow2/qcow2_write_test_util.h"

namespace qcowfs::image {
namespace {

using qcow2::testing::read_file;
using qcow2::testing::shell;
using qcow2::testing::write_file;

TEST(VmdkDescriptorCid, EditsTheTextAsQemuDoes) {
  const std::string text = "# Disk DescriptorFile\nversion=1\nCID=fffffffe\nparentCID=ffffffff\ncreateType=\"x\"\n";
  auto out = vmdk::descriptor_with_cid(text, 0x1a2b);
  ASSERT_TRUE(out) << out.status().to_string();
  EXPECT_EQ(*out, "# Disk DescriptorFile\nversion=1\nCID=1a2b\nparentCID=ffffffff\ncreateType=\"x\"\n");
  auto cid = vmdk::descriptor_cid(*out, false);
  ASSERT_TRUE(cid);
  EXPECT_EQ(*cid, 0x1a2bu);
  // The text ends at its first NUL, as C reads it.
  auto cut = vmdk::descriptor_with_cid(text + std::string(1, '\0') + "junk", 7);
  ASSERT_TRUE(cut);
  EXPECT_EQ(cut->find("junk"), std::string::npos);
  EXPECT_EQ(vmdk::descriptor_with_cid("CID=1\n", 2).status().code(), EINVAL);              // no parentCID
  EXPECT_EQ(vmdk::descriptor_with_cid("CIDx\nparentCID=1\n", 2).status().code(), EINVAL);  // no '=' after CID
}

class VmdkWrite : public ::testing::Test {
 protected:
  void SetUp() override {
    engine_ = std::move(*io::make_engine(io::EngineKind::threads));
    path_ = fmt::format("/var/tmp/qcowfs-vmdk-write-{}.vmdk", ::getpid());
  }
  void TearDown() override { ::unlink(path_.c_str()); }
  template <typename T>
  T run(Task<T> t) {
    return io::run_sync(*engine_, std::move(t));
  }
  void create(const std::string& opts, const std::string& io_cmds = "") {
    std::string out;
    ASSERT_EQ(shell(fmt::format("qemu-img create -q -f vmdk {} {} 8M", opts, path_), &out), 0) << out;
    if (!io_cmds.empty()) {
      ASSERT_EQ(shell(fmt::format("qemu-io -f vmdk {} {}", io_cmds, path_), &out), 0) << out;
    }
  }
  Result<std::unique_ptr<BlockDriver>> open(const std::vector<std::byte>& bytes, io::MemFile** file = nullptr) {
    io::MemFileOptions mo;
    auto mem = std::make_unique<io::MemFile>(mo, bytes);
    if (file) *file = mem.get();
    ImageOptions o;
    o.file.writable = true;
    return run(open_vmdk(std::move(mem), path_, o));
  }
  // A writable open fails with EROFS naming `why` and writes nothing; a
  // read-only open still works.
  void expect_refused(const std::vector<std::byte>& bytes, const std::string& why) {
    io::MemFile* file = nullptr;
    auto d = open(bytes, &file);
    ASSERT_FALSE(d.is_ok()) << why;
    EXPECT_EQ(d.status().code(), EROFS) << d.status().message();
    EXPECT_NE(d.status().message().find(why), std::string::npos) << d.status().message();
    EXPECT_NE(d.status().message().find("mount it read-only"), std::string::npos) << d.status().message();
    io::MemFileOptions mo;
    ImageOptions o;
    auto ro = run(open_vmdk(std::make_unique<io::MemFile>(mo, bytes), path_, o));
    EXPECT_TRUE(ro.is_ok()) << ro.status().to_string();
  }
  static uint64_t header_field(const std::vector<std::byte>& b, size_t at) { return load_le64(b.data() + at); }

  std::unique_ptr<io::Engine> engine_;
  std::string path_;
};

// The redundant grain table names the same new grains as the grain table;
// the CID changed once; qemu-img check is clean.
TEST_F(VmdkWrite, RedundantGrainTableFollowsTheGrainTableAndTheCidChanges) {
  create("");
  const auto before = read_file(path_);
  io::MemFile* file = nullptr;
  auto d = open(before, &file);
  ASSERT_TRUE(d) << d.status().to_string();
  std::vector<std::byte> data(200000, std::byte{0x42});
  ASSERT_TRUE(run((*d)->write(3 * 65536 + 100, data)));
  ASSERT_TRUE(run((*d)->close()));
  const auto after = file->content();
  const uint64_t gd = header_field(after, vmdk::kV4GdOffset) * vmdk::kSector;
  const uint64_t rgd = header_field(after, vmdk::kV4RgdOffset) * vmdk::kSector;
  const uint64_t gt = uint64_t{load_le32(after.data() + gd)} * vmdk::kSector;
  const uint64_t rgt = uint64_t{load_le32(after.data() + rgd)} * vmdk::kSector;
  ASSERT_NE(gt, rgt);
  int allocated = 0;
  for (size_t i = 0; i < 512; ++i) {
    EXPECT_EQ(load_le32(after.data() + gt + i * 4), load_le32(after.data() + rgt + i * 4)) << "entry " << i;
    allocated += load_le32(after.data() + gt + i * 4) != 0;
  }
  EXPECT_EQ(allocated, 4);  // grains 3..6
  const std::string_view old_text(reinterpret_cast<const char*>(before.data()) + 512, 1024);
  const std::string_view new_text(reinterpret_cast<const char*>(after.data()) + 512, 1024);
  auto old_cid = vmdk::descriptor_cid(old_text, false);
  auto new_cid = vmdk::descriptor_cid(new_text, false);
  ASSERT_TRUE(old_cid && new_cid);
  EXPECT_NE(*old_cid, *new_cid);
  EXPECT_EQ(*vmdk::descriptor_cid(new_text, true), *vmdk::descriptor_cid(old_text, true));
  write_file(path_, after);
  std::string out;
  EXPECT_EQ(shell(fmt::format("qemu-img check -f vmdk {}", path_), &out), 0) << out;
  EXPECT_EQ(
      shell(fmt::format("qemu-io -r -f vmdk -c 'read -P 0x42 {} {}' {}", 3 * 65536 + 100, data.size(), path_), &out),
      0);
  EXPECT_EQ(out.find("fail"), std::string::npos) << out;
}

TEST_F(VmdkWrite, StreamOptimizedIsRefused) {
  create("-o subformat=streamOptimized", "-c 'write -P 1 0 64k'");
  expect_refused(read_file(path_), "streamOptimized");
}

TEST_F(VmdkWrite, MissingGrainTableIsRefused) {
  create("");
  auto b = read_file(path_);
  const uint64_t gd = header_field(b, vmdk::kV4GdOffset) * vmdk::kSector;
  store_le32(b.data() + gd, 0);
  expect_refused(b, "names no grain table");
}

TEST_F(VmdkWrite, GrainTablesThatOverlapAreRefused) {
  create("");
  auto b = read_file(path_);
  const uint64_t rgd = header_field(b, vmdk::kV4RgdOffset) * vmdk::kSector;
  const uint64_t gd = header_field(b, vmdk::kV4GdOffset) * vmdk::kSector;
  store_le32(b.data() + rgd, load_le32(b.data() + gd));  // the redundant table is the table itself
  expect_refused(b, "overlaps");
}

TEST_F(VmdkWrite, GrainsThatOverlapAreRefused) {
  create("", "-c 'write -P 1 0 64k' -c 'write -P 2 64k 64k'");
  auto b = read_file(path_);
  const uint64_t gd = header_field(b, vmdk::kV4GdOffset) * vmdk::kSector;
  const uint64_t gt = uint64_t{load_le32(b.data() + gd)} * vmdk::kSector;
  store_le32(b.data() + gt + 4, load_le32(b.data() + gt) + 1);  // grain 1 starts inside grain 0
  expect_refused(b, "overlap");
}

TEST_F(VmdkWrite, GrainInsideTheMetadataIsRefused) {
  create("", "-c 'write -P 1 0 64k'");
  auto b = read_file(path_);
  const uint64_t gd = header_field(b, vmdk::kV4GdOffset) * vmdk::kSector;
  const uint64_t gt = uint64_t{load_le32(b.data() + gd)} * vmdk::kSector;
  store_le32(b.data() + gt, 1);  // the header's sector (1 is not a zeroed grain without the flag)
  expect_refused(b, "outside the grains");
}

TEST_F(VmdkWrite, EmbeddedDescriptorElsewhereIsRefused) {
  create("");
  auto b = read_file(path_);
  store_le64(b.data() + vmdk::kV4DescOffset, 2);
  store_le64(b.data() + vmdk::kV4DescSize, 1);
  expect_refused(b, "not at sector 1");
}

}  // namespace
}  // namespace qcowfs::image
