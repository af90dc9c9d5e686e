// The VHDX driver: CRC-32C against known vectors, the header choice, the
// geometry QEMU derives (chunk ratio, BAT entries with its uint32 wrap), and
// images made by qemu-img (edited with unit/vhdx/vhdx_test_edit.h) opened from
// memory: bytes as qemu-img convert shows them, BAT states, refusals (log that
// needs replay, 4096-byte logical sectors, BAT past EOF).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "image/endian.h"
#include "image/vhdx/crc32c.h"
#include "image/vhdx/format.h"
#include "image/vhdx/header.h"
#include "image/vhdx/log_writer.h"
#include "image/vhdx/vhdx.h"
#include "io/engine.h"
#include "io/mem_file.h"
#include "io/run_sync.h"
#include "unit/io/io_test_util.h"
#include "unit/vhdx/vhdx_test_edit.h"

namespace qcowfs::image {
namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<std::byte>;
using vhdx::kMiB;

Bytes bytes_of(std::string_view s) {
  Bytes b(s.size());
  std::memcpy(b.data(), s.data(), s.size());
  return b;
}

// ---- CRC-32C ----

TEST(VhdxCrc32c, KnownVectors) {
  EXPECT_EQ(vhdx::crc32c(bytes_of("123456789")), 0xE3069283u);
  EXPECT_EQ(vhdx::crc32c(Bytes(32, std::byte{0})), 0x8A9136AAu);  // RFC 3720 B.4
  EXPECT_EQ(vhdx::crc32c(Bytes(32, std::byte{0xFF})), 0x62A8AB43u);
  Bytes inc(32);
  for (size_t i = 0; i < inc.size(); ++i) inc[i] = std::byte(i);
  EXPECT_EQ(vhdx::crc32c(inc), 0x46DD794Eu);
  EXPECT_EQ(vhdx::crc32c({}), 0u);
}

TEST(VhdxCrc32c, SplitFeedsEqualOneFeed) {
  std::mt19937 rng(7);
  Bytes data(10007);
  for (auto& b : data) b = std::byte(rng() & 0xFF);
  const uint32_t whole = vhdx::crc32c(data);
  for (size_t cut : {0u, 1u, 7u, 8u, 9u, 4096u, 10006u}) {
    uint32_t c = vhdx::crc32c_update(0xFFFFFFFFu, std::span(data).first(cut));
    c = vhdx::crc32c_update(c, std::span(data).subspan(cut));
    EXPECT_EQ(~c, whole) << cut;
  }
}

TEST(VhdxCrc32c, ZeroedFieldIsTakenAsZeros) {
  Bytes block(64, std::byte{0x5A});
  Bytes zeroed = block;
  std::memset(zeroed.data() + 4, 0, 4);
  EXPECT_EQ(vhdx::crc32c_with_zeroed_field(block, 4), vhdx::crc32c(zeroed));
}

// ---- Headers ----

Bytes header_block(uint64_t seq, uint32_t log_length = kMiB) {
  Bytes b(vhdx::kHeaderSize);
  store_le32(b.data(), vhdx::kHeaderSignature);
  store_le64(b.data() + vhdx::header_field::kSequenceNumber, seq);
  store_le16(b.data() + vhdx::header_field::kVersion, 1);
  store_le32(b.data() + vhdx::header_field::kLogLength, log_length);
  store_le64(b.data() + vhdx::header_field::kLogOffset, kMiB);
  store_le32(b.data() + 4, vhdx::crc32c_with_zeroed_field(b, 4));
  return b;
}

TEST(VhdxHeader, LargerSequenceNumberIsCurrent) {
  auto h = vhdx::choose_header(header_block(5), header_block(6), "x");
  ASSERT_TRUE(h) << h.status().to_string();
  EXPECT_EQ(h->index, 1);
  h = vhdx::choose_header(header_block(9), header_block(6), "x");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->index, 0);
}

TEST(VhdxHeader, BadChecksumFallsBackToTheOtherHeader) {
  Bytes newer = header_block(9);
  newer[100] ^= std::byte{1};
  auto h = vhdx::choose_header(newer, header_block(6), "x");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->index, 1);
  EXPECT_EQ(h->sequence_number, 6u);
}

TEST(VhdxHeader, BothBadIsRefused) {
  Bytes a = header_block(1), b = header_block(2);
  a[4] ^= std::byte{1};
  store_le16(b.data() + vhdx::header_field::kVersion, 2);  // wrong version (checksum now wrong too)
  auto h = vhdx::choose_header(a, b, "img.vhdx");
  ASSERT_FALSE(h);
  EXPECT_EQ(h.status().code(), EINVAL);
  EXPECT_NE(h.status().message().find("img.vhdx: no valid VHDX header"), std::string::npos);
}

TEST(VhdxHeader, EqualSequenceNumbersNeedIdenticalHeaders) {
  auto same = vhdx::choose_header(header_block(4), header_block(4), "x");
  ASSERT_TRUE(same);
  EXPECT_EQ(same->index, 0);
  auto differ = vhdx::choose_header(header_block(4), header_block(4, 2 * kMiB), "x");
  EXPECT_FALSE(differ);
}

// ---- Geometry ----

vhdx::Parameters params(uint32_t block, uint64_t size) {
  vhdx::Parameters p;
  p.block_size = block;
  p.virtual_disk_size = size;
  p.logical_sector_size = 512;
  p.physical_sector_size = 4096;
  return p;
}

TEST(VhdxGeometry, ChunkRatioInterleavesBitmapEntries) {
  auto g = vhdx::make_geometry(params(1 * kMiB, 8192 * kMiB), 1 << 20, "x");
  ASSERT_TRUE(g) << g.status().to_string();
  EXPECT_EQ(g->chunk_ratio, 4096u);  // 2^23 * 512 / 1 MiB
  EXPECT_EQ(g->bat_entries, 8192u + 1u);
  EXPECT_EQ(g->bat_index(0), 0u);
  EXPECT_EQ(g->bat_index(4095 * kMiB + 7), 4095u);
  EXPECT_EQ(g->bat_index(4096 * kMiB), 4097u);  // entry 4096 is the first sector bitmap
  auto big = vhdx::make_geometry(params(256 * kMiB, 300 * kMiB), 1 << 20, "x");
  ASSERT_TRUE(big);
  EXPECT_EQ(big->chunk_ratio, 16u);
  EXPECT_EQ(big->bat_entries, 2u);
}

TEST(VhdxGeometry, SizeRoundsDownToSectorsAndZeroSizeWrapsAsInQemu) {
  auto odd = vhdx::make_geometry(params(1 * kMiB, 16 * kMiB - 100), 1 << 20, "x");
  ASSERT_TRUE(odd);
  EXPECT_EQ(odd->size, 16 * kMiB - 512);
  EXPECT_EQ(odd->bat_entries, 16u);
  // data_blocks - 1 wraps: QEMU wants 0xFFFFFFFF >> 9 entries for 8 MiB blocks.
  auto zero = vhdx::make_geometry(params(8 * kMiB, 0), 64 << 20, "x");
  ASSERT_TRUE(zero) << zero.status().to_string();
  EXPECT_EQ(zero->bat_entries, 0x7FFFFFu);
  EXPECT_FALSE(vhdx::make_geometry(params(8 * kMiB, 0), 1 << 20, "x"));
}

TEST(VhdxGeometry, RefusesWhatQemuRefuses) {
  auto p = params(3 * kMiB, 16 * kMiB);
  EXPECT_EQ(vhdx::make_geometry(p, 1 << 20, "x").status().code(), EINVAL);
  p = params(512 * kMiB, 16 * kMiB);
  EXPECT_EQ(vhdx::make_geometry(p, 1 << 20, "x").status().code(), EINVAL);
  p = params(1 * kMiB, 16 * kMiB);
  p.logical_sector_size = 4096;
  auto l = vhdx::make_geometry(p, 1 << 20, "x");
  EXPECT_EQ(l.status().code(), ENOTSUP);
  EXPECT_NE(l.status().message().find("logical sector size 4096"), std::string::npos);
  p = params(1 * kMiB, 16 * kMiB);
  p.flags = vhdx::kHasParent;
  EXPECT_EQ(vhdx::make_geometry(p, 1 << 20, "x").status().code(), EINVAL);
  p = params(1 * kMiB, 1024 * kMiB);
  EXPECT_NE(vhdx::make_geometry(p, 512, "x").status().message().find("too small"), std::string::npos);
  p = params(256 * kMiB, 65 * vhdx::kTiB);
  EXPECT_NE(vhdx::make_geometry(p, 1u << 31, "x").status().message().find("64 TiB"), std::string::npos);
}

// ---- Images made by qemu-img ----

class VhdxImage : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path("/var/tmp") / ("qcowfs_vhdx_test_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    auto e = io::make_engine(io::EngineKind::automatic);
    ASSERT_TRUE(e.is_ok());
    engine_ = std::move(*e);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Runs shell commands (qemu-img, qemu-io) in the scratch directory.
  void sh(const std::string& commands) {
    std::string cmd = "cd '" + dir_.string() + "' && { " + commands + "; } >/dev/null 2>&1";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  }
  // Loads image `name` of the scratch directory, lets `change` edit it, saves it.
  template <typename F>
  void edit(const std::string& name, F change) {
    auto e = vhdx::testing::Editor::load((dir_ / name).string());
    change(e);
    e.save((dir_ / name).string());
  }
  // i.vhdx: 16 MiB, 1 MiB blocks (FULLY_PRESENT data at 0, 3 MiB, 15 MiB).
  void make_base() {
    sh("qemu-img create -q -f vhdx -o block_size=1M,block_state_zero=off i.vhdx 16M && "
       "qemu-io -c 'write -P 0x11 0 1M' -c 'write -P 0x22 3M 4k' -c 'write -P 0x33 15M 1M' i.vhdx");
  }
  Bytes slurp(const std::string& name) { return io::testing::read_file((dir_ / name).string()); }
  Result<std::unique_ptr<BlockDriver>> open(bool writable = false, uint64_t cache_bytes = 0) {
    io::MemFileOptions o;
    o.writable = false;
    o.path = (dir_ / "i.vhdx").string();
    auto f = std::make_unique<io::MemFile>(o, slurp("i.vhdx"));
    ImageOptions opts;
    opts.file.writable = writable;
    opts.table_cache_size = cache_bytes;
    return io::run_sync(*engine_, open_vhdx(std::move(f), o.path, opts));
  }
  Result<Bytes> read(BlockDriver& d, uint64_t off, size_t len) {
    Bytes b(len);
    Status st = io::run_sync(*engine_, d.read(off, b));
    if (!st) return st;
    return b;
  }
  // Reads the whole disk in `chunk`-byte reads and compares with qemu-img convert.
  void expect_reads_as_qemu(BlockDriver& d, size_t chunk) {
    sh("qemu-img convert -f vhdx -O raw i.vhdx ref.raw");
    const Bytes ref = slurp("ref.raw");
    ASSERT_EQ(d.size(), ref.size());
    for (uint64_t off = 0; off < ref.size(); off += chunk) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(chunk, ref.size() - off));
      auto got = read(d, off, n);
      ASSERT_TRUE(got) << got.status().to_string();
      ASSERT_TRUE(std::equal(got->begin(), got->end(), ref.begin() + static_cast<ptrdiff_t>(off)))
          << "differs from qemu-img convert at " << off;
    }
  }

  fs::path dir_;
  std::unique_ptr<io::Engine> engine_;
};

// A valid pending log entry writing 0x77 over the 4 KiB at 8 KiB of block 0's data.
void write_pending_0x77(vhdx::testing::Editor& e) {
  e.write_pending_log({{(e.bat(0) & vhdx::kBatOffsetMask) + 8192, Bytes(4096, std::byte{0x77})}});
}

TEST_F(VhdxImage, ReadsWhatQemuImgConvertShows) {
  make_base();
  auto d = open();
  ASSERT_TRUE(d) << d.status().to_string();
  EXPECT_EQ((*d)->format_name(), "vhdx");
  EXPECT_EQ((*d)->details().cluster_size, 1 * kMiB);
  EXPECT_EQ((*d)->details().dirty, std::optional<bool>(false));
  expect_reads_as_qemu(**d, 3 * kMiB + 512);  // reads across block boundaries
  expect_reads_as_qemu(**d, 4096);
}

TEST_F(VhdxImage, BlockStatusIsOneDataRangeWithoutOffset) {
  make_base();
  auto d = open();
  ASSERT_TRUE(d);
  auto st = io::run_sync(*engine_, (*d)->block_status(5 * kMiB, 11 * kMiB));
  ASSERT_TRUE(st);
  EXPECT_EQ(st->length, 11 * kMiB);
  EXPECT_TRUE(st->data && st->present && !st->zero);
  EXPECT_EQ(st->file, nullptr);
}

TEST_F(VhdxImage, ZeroUndefinedAndUnmappedStatesReadZeros) {
  make_base();
  edit("i.vhdx", [](vhdx::testing::Editor& e) {
    e.set_bat_state(0, vhdx::kUndefined);
    e.set_bat_state(3, vhdx::kUnmapped);
    e.set_bat_state(15, vhdx::kUnmappedV095);
  });
  auto d = open();
  ASSERT_TRUE(d) << d.status().to_string();
  for (uint64_t block : {0u, 3u, 15u}) {
    auto got = read(**d, block * kMiB, 1 * kMiB);
    ASSERT_TRUE(got);
    EXPECT_EQ(*got, Bytes(kMiB, std::byte{0})) << block;
  }
  expect_reads_as_qemu(**d, 2 * kMiB);
}

TEST_F(VhdxImage, PartiallyPresentAndState4AreEio) {
  make_base();
  edit("i.vhdx", [](vhdx::testing::Editor& e) {
    e.set_bat_state(0, vhdx::kPartiallyPresent);
    e.set_bat_state(3, 4);
  });
  auto d = open();
  ASSERT_TRUE(d) << d.status().to_string();
  EXPECT_EQ(read(**d, 4096, 512).status().code(), EIO);
  EXPECT_EQ(read(**d, 3 * kMiB, 4096).status().code(), EIO);
  EXPECT_TRUE(read(**d, 1 * kMiB, 2 * kMiB));  // the blocks between read fine
}

TEST_F(VhdxImage, FullyPresentInTheHeaderSectionIsEio) {
  make_base();
  edit("i.vhdx", [](vhdx::testing::Editor& e) { e.set_bat(0, vhdx::kFullyPresent); });  // file offset 0
  auto d = open();
  ASSERT_TRUE(d) << d.status().to_string();
  EXPECT_EQ(read(**d, 0, 4096).status().code(), EIO);
}

TEST_F(VhdxImage, BatEntryPastTheEndOfTheFileIsRefused) {
  make_base();
  edit("i.vhdx", [](vhdx::testing::Editor& e) {
    e.set_bat(3, vhdx::testing::bat_entry(vhdx::kFullyPresent, 1ull << 40));
  });
  auto d = open();
  ASSERT_FALSE(d);
  EXPECT_NE(d.status().message().find("beyond the end of the file"), std::string::npos) << d.status().message();
}

TEST_F(VhdxImage, LogThatNeedsReplayIsRefusedWithQemusAdvice) {
  make_base();
  edit("i.vhdx", write_pending_0x77);
  sh("! qemu-img info i.vhdx");
  auto d = open();
  ASSERT_FALSE(d);
  EXPECT_EQ(d.status().code(), EPERM);
  EXPECT_NE(d.status().message().find("contains a log that needs to be replayed"), std::string::npos);
  EXPECT_NE(d.status().message().find("qemu-img check -r all"), std::string::npos);
}

TEST_F(VhdxImage, ReplayedLogOpensWithTheLoggedData) {
  make_base();
  // QEMU replays on a read-write open (check -r all); the result reads as qemu says.
  edit("i.vhdx", write_pending_0x77);
  sh("qemu-img check -q -r all i.vhdx");
  auto d = open();
  ASSERT_TRUE(d) << d.status().to_string();
  auto logged = read(**d, 8192, 4096);
  ASSERT_TRUE(logged);
  EXPECT_EQ(*logged, Bytes(4096, std::byte{0x77}));
  expect_reads_as_qemu(**d, 1 * kMiB);
}

TEST_F(VhdxImage, LogGuidWithoutValidEntriesOpens) {
  make_base();
  edit("i.vhdx", [](vhdx::testing::Editor& e) { e.set_log_guid(e.current_header_index(), vhdx::random_guid()); });
  sh("qemu-img info i.vhdx");
  auto d = open();
  ASSERT_TRUE(d) << d.status().to_string();
}

TEST_F(VhdxImage, LogicalSectorSize4096IsRefusedAsInQemu) {
  make_base();
  edit("i.vhdx", [](vhdx::testing::Editor& e) { e.set_metadata_u32(vhdx::kLogicalSectorSizeGuid, 4096); });
  sh("! qemu-img info i.vhdx");
  auto d = open();
  ASSERT_FALSE(d);
  EXPECT_EQ(d.status().code(), ENOTSUP);
}

TEST_F(VhdxImage, WritableOpenOpens) {  // writes: vhdx_write_test.cc
  make_base();
  auto d = open(true);
  ASSERT_TRUE(d) << d.status().to_string();
  EXPECT_FALSE((*d)->read_only());
}

TEST_F(VhdxImage, FixedImageIsOneExtentPerContiguousRun) {
  sh("qemu-img create -q -f vhdx -o subformat=fixed,block_size=1M,block_state_zero=off i.vhdx 8M && "
     "qemu-io -c 'write -P 0x44 1M 6M' i.vhdx");
  auto d = open();
  ASSERT_TRUE(d) << d.status().to_string();
  expect_reads_as_qemu(**d, 8 * kMiB);
}

TEST_F(VhdxImage, BatSlicesAreEvictedAndReloadedWithATwoSliceCache) {
  // 1400 blocks of 1 MiB: three 4 KiB BAT slices (512 entries each, bitmaps included).
  sh("qemu-img create -q -f vhdx -o block_size=1M i.vhdx 1400M && "
     "qemu-io -c 'write -P 0x51 0 1M' -c 'write -P 0x52 600M 1M' -c 'write -P 0x53 1100M 1M' "
     "-c 'write -P 0x54 1399M 1M' i.vhdx");
  auto d = open(false, 8192);
  ASSERT_TRUE(d) << d.status().to_string();
  const std::pair<uint64_t, uint8_t> blocks[] = {{0, 0x51}, {600, 0x52}, {1100, 0x53}, {1399, 0x54}, {700, 0}};
  for (int round = 0; round < 3; ++round) {
    for (auto [block, fill] : blocks) {
      auto got = read(**d, block * kMiB, kMiB);
      ASSERT_TRUE(got) << got.status().to_string();
      EXPECT_EQ(*got, Bytes(kMiB, std::byte{fill})) << block;
    }
  }
  // One read across every slice: zeros between the written blocks.
  auto all = read(**d, 599 * kMiB, 3 * kMiB);
  ASSERT_TRUE(all);
  EXPECT_EQ((*all)[0], std::byte{0});
  EXPECT_EQ((*all)[kMiB], std::byte{0x52});
  EXPECT_EQ((*all)[2 * kMiB], std::byte{0});
}

}  // namespace
}  // namespace qcowfs::image
