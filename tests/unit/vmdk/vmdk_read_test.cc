// VMDK: the descriptor parser (QEMU's sscanf/strstr rules, bounds), the
// sparse header layout, and the driver over images made with qemu-img (bytes
// equal to qemu-img convert, refusals of hostile headers).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "image/block_driver.h"
#include "image/endian.h"
#include "image/vmdk/descriptor.h"
#include "image/vmdk/format.h"
#include "io/engine.h"
#include "io/run_sync.h"
#include "io/when_all.h"
#include "unit/io/io_test_util.h"

namespace qcowfs::image {
namespace {

using namespace vmdk;
namespace fs = std::filesystem;
using Bytes = std::vector<std::byte>;

constexpr std::string_view kFlat =
    "# Disk DescriptorFile\n"
    "version=1\n"
    "CID=e565aabd\n"
    "parentCID=ffffffff\n"
    "createType=\"monolithicFlat\"\n"
    "\n"
    "# Extent description\n"
    "RW 32768 FLAT \"f-flat.vmdk\" 0\n"
    "\n"
    "ddb.adapterType = \"ide\"\n";

TEST(VmdkDescriptor, ParsesQemuMonolithicFlat) {
  auto d = parse_descriptor(kFlat);
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  EXPECT_EQ(d->create_type, "monolithicFlat");
  EXPECT_EQ(d->cid, 0xe565aabdu);
  EXPECT_EQ(d->parent_cid, 0xffffffffu);
  EXPECT_FALSE(d->parent_hint.has_value());
  ASSERT_EQ(d->extents.size(), 1u);
  EXPECT_EQ(d->extents[0].type, "FLAT");
  EXPECT_EQ(d->extents[0].sectors, 32768);
  EXPECT_EQ(d->extents[0].file, "f-flat.vmdk");
  EXPECT_EQ(d->extents[0].flat_offset, 0);
}

TEST(VmdkDescriptor, SkipsZeroReadOnlyAndUnknownExtentsAsQemuDoes) {
  auto ex = descriptor_extents(
      "RW 100 ZERO\n"
      "RW 100 ZERO \"z\"\n"
      "RDONLY 100 FLAT \"r\" 0\n"
      "NOACCESS 100 SPARSE \"n\"\n"
      "RW 0 SPARSE \"empty\"\n"
      "RW 7 VMFS \"v\"\n"
      "RW 9 SPARSE \"s.vmdk\"\r\n"
      "RW 3 FLAT \"f with space\" 12\n");
  ASSERT_TRUE(ex.is_ok()) << ex.status().to_string();
  ASSERT_EQ(ex->size(), 3u);
  EXPECT_EQ((*ex)[0].type, "VMFS");
  EXPECT_EQ((*ex)[0].flat_offset, 0);
  EXPECT_EQ((*ex)[1].file, "s.vmdk");
  EXPECT_EQ((*ex)[2].file, "f with space");
  EXPECT_EQ((*ex)[2].flat_offset, 12);
}

TEST(VmdkDescriptor, RefusesMalformedLinesOfKnownTypes) {
  for (const char* line : {"RW 10 FLAT \"f\"\n", "RW 10 FLAT \"f\" -1\n", "RW 10 SPARSE \"s\" 5\n",
                           "RW 10 VMFS \"v\" 1\n"}) {
    auto ex = descriptor_extents(line);
    ASSERT_FALSE(ex.is_ok()) << line;
    EXPECT_EQ(ex.status().code(), EINVAL) << line;
  }
}

TEST(VmdkDescriptor, TextEndsAtNulAndSizesClamp) {
  std::string text = "RW 10 FLAT \"a\" 0\n";
  text += '\0';
  text += "RW 10 FLAT \"b\" 0\n";
  auto ex = descriptor_extents(text);
  ASSERT_TRUE(ex.is_ok());
  EXPECT_EQ(ex->size(), 1u);
  auto big = descriptor_extents("RW 99999999999999999999999 FLAT \"a\" 0\n");
  ASSERT_TRUE(big.is_ok());
  ASSERT_EQ(big->size(), 1u);
  EXPECT_EQ((*big)[0].sectors, INT64_MAX);
}

TEST(VmdkDescriptor, BoundsTheNumberOfExtents) {
  std::string text;
  for (size_t i = 0; i <= kMaxExtents; ++i) text += "RW 1 FLAT \"f\" 0\n";
  auto ex = descriptor_extents(text);
  ASSERT_FALSE(ex.is_ok());
  EXPECT_EQ(ex.status().code(), EINVAL);
}

TEST(VmdkDescriptor, CreateTypeRules) {
  EXPECT_EQ(descriptor_create_type("createType=\"twoGbMaxExtentSparse\"").status().code(), 0);
  EXPECT_EQ(descriptor_create_type("createType=\"monolithicSparse\"").status().code(), ENOTSUP);
  EXPECT_EQ(descriptor_create_type("no type here").status().code(), EINVAL);
  EXPECT_EQ(descriptor_create_type("createType=\"unterminated").status().code(), EINVAL);
  EXPECT_EQ(descriptor_create_type("createType=\"" + std::string(200, 'x') + "\"").status().code(), EINVAL);
}

TEST(VmdkDescriptor, CidIsTheFirstStrstrMatch) {
  auto cid = descriptor_cid("parentCID=ffffffff\nCID=1234\n", false);
  ASSERT_TRUE(cid.is_ok());
  EXPECT_EQ(*cid, 0xffffffffu);  // "CID" first occurs inside "parentCID", as in QEMU
  EXPECT_EQ(descriptor_cid("CID=zz\n", false).status().code(), EINVAL);
  EXPECT_EQ(descriptor_cid("nothing\n", true).status().code(), EINVAL);
  std::string far(kDescWindow, ' ');
  EXPECT_EQ(descriptor_cid(far + "CID=1\n", false).status().code(), EINVAL);  // outside QEMU's window
}

TEST(VmdkDescriptor, ParentHint) {
  auto h = descriptor_parent_hint("parentFileNameHint=\"base.vmdk\"\n");
  ASSERT_TRUE(h.is_ok());
  ASSERT_TRUE(h->has_value());
  EXPECT_EQ(**h, "base.vmdk");
  EXPECT_EQ(descriptor_parent_hint("parentFileNameHint=\"open").status().code(), EINVAL);
  EXPECT_EQ(descriptor_parent_hint("parentFileNameHint").status().code(), EINVAL);
  EXPECT_EQ(descriptor_parent_hint("parentFileNameHint=\"" + std::string(5000, 'p') + "\"").status().code(), EINVAL);
  auto none = descriptor_parent_hint("CID=1\n");
  ASSERT_TRUE(none.is_ok());
  EXPECT_FALSE(none->has_value());
}

TEST(VmdkHeader, ParsesTheKdmvLayout) {
  Bytes b(512);
  store_be32(b.data(), kVmdk4MagicBe);
  store_le32(b.data() + kV4Version, 3);
  store_le32(b.data() + kV4Flags, kFlagZeroGrain | kFlagMarkers);
  store_le64(b.data() + kV4Capacity, 4096);
  store_le64(b.data() + kV4Granularity, 128);
  store_le64(b.data() + kV4DescOffset, 1);
  store_le32(b.data() + kV4NumGtes, 512);
  store_le64(b.data() + kV4GdOffset, kGdAtEnd);
  store_le64(b.data() + kV4GrainOffset, 128);
  store_le16(b.data() + kV4Compress, kCompressionDeflate);
  SparseHeader h = parse_sparse_header(b);
  EXPECT_FALSE(h.vmdk3);
  EXPECT_EQ(h.version, 3u);
  EXPECT_EQ(h.flags, kFlagZeroGrain | kFlagMarkers);
  EXPECT_EQ(h.capacity, 4096u);
  EXPECT_EQ(h.granularity, 128u);
  EXPECT_EQ(h.desc_offset, 1u);
  EXPECT_EQ(h.num_gtes_per_gt, 512u);
  EXPECT_EQ(h.gd_offset, kGdAtEnd);
  EXPECT_EQ(h.grain_offset, 128u);
  EXPECT_EQ(h.compress_algorithm, kCompressionDeflate);
  // A short buffer reads as zero-padded.
  SparseHeader s = parse_sparse_header(std::span(b).first(16));
  EXPECT_EQ(s.capacity & 0xffffffffu, 4096u);
  EXPECT_EQ(s.granularity, 0u);
}

class VmdkImage : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path("/var/tmp") / ("qcowfs_vmdk_test_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    auto e = io::make_engine(io::EngineKind::automatic);
    ASSERT_TRUE(e.is_ok()) << e.status().to_string();
    engine_ = std::move(*e);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& n) const { return (dir_ / n).string(); }
  void sh(const std::string& cmd) {
    std::string full = "cd '" + dir_.string() + "' && { " + cmd + "; } >/dev/null 2>&1";
    ASSERT_EQ(std::system(full.c_str()), 0) << full;
  }
  static Bytes slurp(const std::string& p) { return io::testing::read_file(p); }
  Result<std::unique_ptr<BlockDriver>> open(const std::string& name) {
    return io::run_sync(*engine_, open_image(path(name), ImageOptions{}));
  }
  void expect_like_qemu(const std::string& name) {
    sh("qemu-img convert -O raw " + name + " " + name + ".ref");
    Bytes want = slurp(path(name + ".ref"));
    auto d = open(name);
    ASSERT_TRUE(d.is_ok()) << d.status().to_string();
    ASSERT_EQ((*d)->size(), want.size());
    Bytes got(want.size());
    for (size_t chunk : {size_t{65536}, size_t{12345}}) {
      std::fill(got.begin(), got.end(), std::byte{0xee});
      for (uint64_t off = 0; off < got.size(); off += chunk) {
        size_t n = std::min<uint64_t>(chunk, got.size() - off);
        Status st = io::run_sync(*engine_, (*d)->read(off, std::span(got).subspan(off, n)));
        ASSERT_TRUE(st.is_ok()) << st.to_string();
      }
      EXPECT_TRUE(got == want) << name << " differs from qemu-img convert (chunk " << chunk << ")";
    }
    EXPECT_TRUE(io::run_sync(*engine_, (*d)->close()).is_ok());
  }
  void poke(const std::string& name, uint64_t off, const Bytes& b) {
    std::fstream f(path(name), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(off));
    f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
  }
  static Bytes le64(uint64_t v) {
    Bytes b(8);
    store_le64(b.data(), v);
    return b;
  }
  static Bytes le32(uint32_t v) {
    Bytes b(4);
    store_le32(b.data(), v);
    return b;
  }

  fs::path dir_;
  std::unique_ptr<io::Engine> engine_;
};

TEST_F(VmdkImage, SparseFlatAndStreamReadLikeQemu) {
  sh("qemu-img create -q -f vmdk s.vmdk 8M && qemu-io -f vmdk -c 'write -P 0x11 60k 72k' -c 'write -P 0x12 7M 4k' s.vmdk");
  expect_like_qemu("s.vmdk");
  sh("qemu-img create -q -f vmdk -o subformat=monolithicFlat f.vmdk 8M && qemu-io -f vmdk -c 'write -P 0x21 1M 3k' f.vmdk");
  expect_like_qemu("f.vmdk");
  sh("qemu-img convert -O vmdk -o subformat=streamOptimized s.vmdk so.vmdk");
  expect_like_qemu("so.vmdk");
}

TEST_F(VmdkImage, RefusesHostileHeaders) {
  struct Case {
    uint64_t at;
    Bytes value;
    int err;
  };
  const std::vector<Case> cases = {
      {kV4Version, le32(4), ENOTSUP},
      {kV4NumGtes, le32(513), EINVAL},
      {kV4NumGtes, le32(0), EINVAL},
      {kV4Granularity, le64(0), EINVAL},
      {kV4Granularity, le64(kMaxGrainSectors * 2), EFBIG},
      {kV4GrainOffset, le64(1ull << 40), EINVAL},
  };
  for (const Case& c : cases) {
    sh("rm -f h.vmdk && qemu-img create -q -f vmdk h.vmdk 8M");
    poke("h.vmdk", c.at, c.value);
    auto d = open("h.vmdk");
    ASSERT_FALSE(d.is_ok()) << "field at " << c.at;
    EXPECT_EQ(d.status().code(), c.err) << d.status().to_string();
  }
}

TEST_F(VmdkImage, GrainTableEntryPastEndOfFileReadsAsZerosLikeQemu) {
  sh("qemu-img create -q -f vmdk g.vmdk 8M && qemu-io -f vmdk -c 'write -P 0x11 0 64k' g.vmdk");
  // The first grain-table entry: the GD (at gd_offset) names the GT.
  Bytes head = slurp(path("g.vmdk"));
  uint64_t gd = load_le64(head.data() + kV4GdOffset) * 512;
  uint64_t gt = uint64_t{load_le32(head.data() + gd)} * 512;
  poke("g.vmdk", gt, le32(0x7fffff00));
  expect_like_qemu("g.vmdk");
}

// A VMFS "COWD" sparse file by hand (qemu-img cannot make one): 4 MiB, 4 KiB
// grains, one GD entry, 4096-entry GT; grain-table entries to grains, to
// sector 1 (no zeroed-grain flag in COWD: data), and the last grain past EOF.
// QEMU needs CID/parentCID at 0x200 even here.
TEST_F(VmdkImage, CowdSparseReadsLikeQemu) {
  Bytes b(35 * 512 + 2 * 4096 + 1000);
  store_be32(b.data(), kVmdk3MagicBe);
  store_le32(b.data() + kV3Version, 1);
  store_le32(b.data() + kV3Flags, 3);
  store_le32(b.data() + kV3DiskSectors, 8192);
  store_le32(b.data() + kV3Granularity, 8);
  store_le32(b.data() + kV3L1Offset, 2);
  store_le32(b.data() + kV3L1Size, 1);
  std::string cid = "CID=12345678\nparentCID=ffffffff\n";
  std::memcpy(b.data() + 512, cid.data(), cid.size());
  store_le32(b.data() + 2 * 512, 3);
  const std::pair<uint32_t, uint32_t> gtes[] = {{0, 35}, {3, 43}, {5, 1}, {1023, 51}};
  for (auto [i, sector] : gtes) store_le32(b.data() + 3 * 512 + 4 * i, sector);
  for (size_t i = 35 * 512; i < b.size(); ++i) b[i] = std::byte{static_cast<unsigned char>(0x41 + (i - 35 * 512) / 4096)};
  std::ofstream(path("c.vmdk"), std::ios::binary).write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
  expect_like_qemu("c.vmdk");
}

// A write changes a VMDK's CID (QEMU's vmdk_write_cid); a delta made before it
// records the old one as parentCID and is refused, at every level of a chain
// and also when opened without its parent (info), with both CIDs named. A
// delta made after the write opens; without a readable parent info still works.
TEST_F(VmdkImage, DeltaOverAParentWrittenSinceIsRefused) {
  sh("qemu-img create -q -f vmdk base.vmdk 1M && qemu-img create -q -f vmdk -b base.vmdk -F vmdk delta.vmdk"
     " && qemu-img create -q -f vmdk -b delta.vmdk -F vmdk top.vmdk");
  ASSERT_TRUE(open("top.vmdk").is_ok());
  sh("qemu-io -f vmdk -c 'write 0 512' base.vmdk && qemu-img create -q -f vmdk -b base.vmdk -F vmdk fresh.vmdk");
  auto cid_at_0x200 = [&](const std::string& name, bool parent) {
    Bytes b = slurp(path(name));
    std::string text(reinterpret_cast<const char*>(b.data()) + kDescOffsetInSparse, kDescWindow);
    return *descriptor_cid(text, parent);
  };
  const std::string cids = fmt::format("parentCID {:08x}, parent's CID {:08x}", cid_at_0x200("delta.vmdk", true),
                                       cid_at_0x200("base.vmdk", false));
  ImageOptions alone;
  alone.no_backing = true;
  for (const auto& [name, opts] : {std::pair{"delta.vmdk", ImageOptions{}}, std::pair{"top.vmdk", ImageOptions{}},
                                   std::pair{"delta.vmdk", alone}}) {
    auto d = io::run_sync(*engine_, open_image(path(name), opts));
    ASSERT_FALSE(d.is_ok()) << name;
    EXPECT_EQ(d.status().code(), EINVAL);
    const std::string msg = d.status().to_string();
    EXPECT_NE(msg.find(path("delta.vmdk") + ": its parent " + path("base.vmdk") + " was modified since"),
              std::string::npos) << msg;
    EXPECT_NE(msg.find(cids), std::string::npos) << msg;
  }
  EXPECT_TRUE(open("fresh.vmdk").is_ok());
  fs::remove(path("base.vmdk"));
  EXPECT_TRUE(io::run_sync(*engine_, open_image(path("delta.vmdk"), alone)).is_ok());
}

// Grain tables in several 4 KiB windows (one per 64 MiB of disk), read by
// eight concurrent requests at a time: the TableCache shares and evicts
// windows (two slices in QCOWFS_TINY_CACHE builds).
TEST_F(VmdkImage, ConcurrentReadsAcrossGrainTableWindows) {
  sh("qemu-img create -q -f vmdk w.vmdk 300M && qemu-io -f vmdk -c 'write -P 0x31 0 64k' -c 'write -P 0x32 70M 1M'"
     " -c 'write -P 0x33 140M 128k' -c 'write -P 0x34 210M 64k' -c 'write -P 0x35 299M 1M' w.vmdk");
  sh("qemu-img convert -O raw w.vmdk w.ref");
  Bytes want = slurp(path("w.ref"));
  auto d = open("w.vmdk");
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  Bytes got(want.size(), std::byte{0xee});
  BlockDriver& drv = **d;
  constexpr uint64_t kChunk = 1 << 20;
  const uint64_t chunks = got.size() / kChunk;
  ASSERT_EQ(got.size() % kChunk, 0u);
  auto task = [&]() -> Task<Status> {
    // Chunks 0, N-1, 1, N-2, ...: each once, consecutive requests far apart.
    for (uint64_t k = 0; k < chunks;) {
      std::vector<Task<Status>> batch;
      for (int i = 0; i < 8 && k < chunks; ++i, ++k) {
        uint64_t at = (k % 2 ? chunks - 1 - k / 2 : k / 2) * kChunk;
        batch.push_back(drv.read(at, std::span(got).subspan(at, kChunk)));
      }
      QCOWFS_CO_TRY(co_await io::when_all(std::move(batch)));
    }
    co_return Status::ok();
  };
  Status st = io::run_sync(*engine_, task());
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_TRUE(got == want);
  EXPECT_TRUE(io::run_sync(*engine_, drv.close()).is_ok());
}

}  // namespace
}  // namespace qcowfs::image
