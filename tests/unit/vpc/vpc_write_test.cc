// VpcWriter's own rules over dynamic VHD images (qemu-img's, and ones built in
// memory with 4 KiB blocks): a new block goes where the end footer was, as an
// all-ones sector bitmap then the data; the footer moves to the new end and
// the copy at offset 0 never changes; a request over several new blocks is one
// host write; the first write into an existing block makes its sector bitmap
// all ones, durably, before the data (as QEMU); refusals of a writable open
// (the image bytes unchanged, the read-only open still working); block
// devices; and the states a crash can leave (a clobbered end footer, an
// orphaned block) reopened and written.
// The shared write tests (image_extent_write_test.cc) cover crash images.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "unit/image/forwarding_file.h"
#include "image/endian.h"
#include "image/vpc/vpc.h"
#include "io/mem_file.h"
#include "unit/io/io_test_util.h"
#include "unit/qcow2/qcow2_write_test_util.h"

namespace qcowfs::image {
namespace {

using io::testing::run_now;
using qcow2::testing::read_file;
using qcow2::testing::shell;
using qcow2::testing::write_file;
using Bytes = std::vector<std::byte>;

constexpr uint64_t kMiB = 1 << 20;
constexpr uint64_t kQemuBlock = 2 * kMiB;  // qemu-img's block size; its bitmap is 512 bytes
constexpr uint64_t kQemuBatAt = 1536;      // where qemu-img puts the BAT
constexpr uint64_t kQemuAlign = 65536;     // where qcowfs starts the data of a new 2 MiB block

// In-memory images: 4 KiB blocks (a 512-byte bitmap), 8 BAT entries in one sector.
constexpr uint32_t kBlock = 4096;
constexpr uint32_t kBlocks = 8;
constexpr uint64_t kBatAt = 1536;
constexpr uint64_t kDataAt = 2048;
constexpr uint64_t kStride = 512 + kBlock;
// A new block of qcowfs': zero padding up to 4 KiB before its bitmap, so that
// its data is 4 KiB-aligned.
constexpr uint64_t kNewStride = 4096 + kBlock;

// Where qcowfs puts a new block's bitmap when the file's blocks end at `free`.
uint64_t new_bitmap_at(uint64_t free) { return (free + 4095) / 4096 * 4096 + 4096 - 512; }

void put_footer(Bytes& img, uint64_t at, uint32_t type, uint64_t data_offset = 512) {
  std::byte* p = img.data() + at;
  std::memset(p, 0, 512);
  std::memcpy(p, "conectix", 8);
  store_be64(p + 16, data_offset);
  std::memcpy(p + 28, "qem2", 4);  // sized by current_size
  store_be64(p + 40, uint64_t{kBlocks} * kBlock);
  store_be64(p + 48, uint64_t{kBlocks} * kBlock);
  store_be32(p + 60, type);
  uint32_t sum = 0;
  for (int i = 0; i < 512; ++i) sum += static_cast<uint8_t>(p[i]);
  store_be32(p + 64, ~sum);
}

void put_header(Bytes& img, uint64_t at) {
  std::byte* h = img.data() + at;
  std::memcpy(h, "cxsparse", 8);
  store_be64(h + 8, ~uint64_t{0});
  store_be64(h + 16, kBatAt);
  store_be32(h + 28, kBlocks);
  store_be32(h + 32, kBlock);
}

// A dynamic disk whose BAT names `sectors` (block i at sectors[i], or
// unallocated for 0xFFFFFFFF), data bytes 0x10 + i unless !fill (blocks over
// the metadata), the footer after the last block.
Bytes built_image(const std::vector<uint32_t>& sectors, uint32_t type = 3, bool fill = true) {
  uint64_t end = kDataAt;
  for (uint32_t s : sectors)
    if (s != 0xFFFFFFFF) end = std::max(end, uint64_t{s} * 512 + kStride);
  Bytes img(end + 512);
  put_footer(img, 0, type);
  put_header(img, 512);
  for (uint32_t i = 0; i < kBlocks; ++i) store_be32(img.data() + kBatAt + 4 * i, 0xFFFFFFFF);
  for (size_t i = 0; i < sectors.size(); ++i) {
    store_be32(img.data() + kBatAt + 4 * i, sectors[i]);
    if (sectors[i] == 0xFFFFFFFF || !fill) continue;
    const uint64_t at = uint64_t{sectors[i]} * 512;
    std::fill_n(img.begin() + static_cast<std::ptrdiff_t>(at), 512, std::byte{0xff});
    std::fill_n(img.begin() + static_cast<std::ptrdiff_t>(at + 512), kBlock, std::byte(0x10 + i));
  }
  put_footer(img, img.size() - 512, type);
  return img;
}

// A HostFile the driver uses but does not own: the MemFile outlives a failed open.
class Borrowed final : public qcowfs::testing::ForwardingFile {
 public:
  explicit Borrowed(io::HostFile& f) : ForwardingFile(f) {}
};

struct Opened {
  std::unique_ptr<io::MemFile> file;
  Result<std::unique_ptr<BlockDriver>> driver = Status::error(EIO, "not opened");
};

Opened open(Bytes img, bool writable, bool block_device = false, bool track_unflushed = false) {
  io::MemFileOptions mo;
  mo.block_device = block_device;
  mo.track_unflushed = track_unflushed;
  Opened o;
  o.file = std::make_unique<io::MemFile>(mo, std::move(img));
  ImageOptions opts;
  opts.file.writable = writable;
  o.driver = run_now(open_vpc(std::make_unique<Borrowed>(*o.file), "t.vhd", opts));
  return o;
}

// qemu-img's dynamic disk of `size` bytes (force_size: exactly that size).
class QemuImage {
 public:
  explicit QemuImage(uint64_t size) {
    path_ = fmt::format("/var/tmp/qcowfs-vpc-write-{}-{}.vhd", ::getpid(), counter_++);
    std::string out;
    EXPECT_EQ(
        shell(fmt::format("qemu-img create -q -f vpc -o subformat=dynamic,force_size=on {} {}", path_, size), &out), 0)
        << out;
  }
  ~QemuImage() { ::unlink(path_.c_str()); }
  Bytes bytes() const { return read_file(path_); }
  // What qemu-img convert reads of image.
  Bytes qemu_reads(const Bytes& image) const {
    const std::string copy = path_ + ".copy", raw = path_ + ".raw";
    write_file(copy, image);
    std::string out;
    EXPECT_EQ(shell(fmt::format("qemu-img convert -f vpc -O raw {} {}", copy, raw), &out), 0) << out;
    Bytes got = read_file(raw);
    ::unlink(copy.c_str());
    ::unlink(raw.c_str());
    return got;
  }

 private:
  static inline int counter_ = 0;
  std::string path_;
};

Bytes pattern(size_t n, uint8_t seed) {
  Bytes b(n);
  for (size_t i = 0; i < n; ++i) b[i] = std::byte(static_cast<uint8_t>(seed + i * 7 + i / 4096));
  return b;
}

bool all_are(std::span<const std::byte> s, std::byte v) {
  return std::all_of(s.begin(), s.end(), [v](std::byte b) { return b == v; });
}

// qemu-img's 2 MiB blocks: the data 64 KiB-aligned; of the 63.5 KiB of
// padding only the 3.5 KiB in the bitmap's 4 KiB page is written, the rest
// stays a hole.
TEST(VpcWrite, NewBlockGoesWhereTheFooterWasWithItsData64KiBAlignedAndTheFooterMoves) {
  QemuImage q(8 * kMiB);
  const Bytes before = q.bytes();
  const uint64_t old_end = before.size() - 512;  // the end footer: QEMU's free_data_block_offset
  const uint64_t bitmap = (old_end + kQemuAlign - 1) / kQemuAlign * kQemuAlign + kQemuAlign - 512;
  ASSERT_GT(bitmap, old_end + 512);  // the old footer lies before the next 64 KiB boundary (a hole after it)
  auto o = open(before, true);
  ASSERT_TRUE(o.driver) << o.driver.status().to_string();
  BlockDriver& d = **o.driver;
  const Bytes data = pattern(4096, 3);
  ASSERT_TRUE(run_now(d.write(kQemuBlock + 12345, data)));
  ASSERT_TRUE(run_now(d.close()));
  const Bytes after = o.file->content();
  ASSERT_EQ(after.size(), bitmap + 512 + kQemuBlock + 512);
  EXPECT_TRUE(std::equal(before.begin(), before.begin() + 512, after.begin())) << "the footer copy at 0 changed";
  EXPECT_TRUE(std::equal(before.begin(), before.begin() + 512, after.end() - 512)) << "the end footer is not the copy";
  EXPECT_TRUE(all_are(std::span(after).subspan(bitmap, 512), std::byte{0xff})) << "the bitmap is not all ones";
  EXPECT_TRUE(all_are(std::span(after).subspan(bitmap - 3584, 3584), std::byte{0})) << "the padding";
  auto data_at = run_now(o.file->seek_data((old_end + 512 + 4095) / 4096 * 4096));  // past the old footer's page
  ASSERT_TRUE(data_at) << data_at.status().to_string();
  EXPECT_EQ(*data_at, bitmap + 512 - 4096) << "the padding before the bitmap's 4 KiB page was written";
  EXPECT_TRUE(std::equal(before.end() - 512, before.end(), after.begin() + static_cast<std::ptrdiff_t>(old_end)))
      << "the old end footer, now unused space before the 64 KiB boundary, was written";
  EXPECT_EQ(load_be32(after.data() + kQemuBatAt + 4), bitmap / 512);
  EXPECT_EQ(load_be32(after.data() + kQemuBatAt), 0xFFFFFFFFu);
  EXPECT_TRUE(std::equal(data.begin(), data.end(), after.begin() + static_cast<std::ptrdiff_t>(bitmap + 512 + 12345)));
  // Only the BAT's first sector and the new space changed.
  EXPECT_TRUE(std::equal(before.begin(), before.begin() + kQemuBatAt, after.begin()));
  EXPECT_TRUE(std::equal(before.begin() + kQemuBatAt + 512, before.begin() + static_cast<std::ptrdiff_t>(old_end),
                         after.begin() + kQemuBatAt + 512));
  Bytes want(8 * kMiB);
  std::copy(data.begin(), data.end(), want.begin() + static_cast<std::ptrdiff_t>(kQemuBlock + 12345));
  EXPECT_TRUE(q.qemu_reads(after) == want);
}

// After a flush the end footer lies right at the next block's 64 KiB
// boundary, inside the padding left unwritten: that padding is written (as
// zeros) from the footer on, so no stale footer is left inside the file.
TEST(VpcWrite, AnEndFooterInTheNextBlocksPaddingIsWrittenOver) {
  QemuImage q(8 * kMiB);
  auto o = open(q.bytes(), true);
  ASSERT_TRUE(o.driver) << o.driver.status().to_string();
  BlockDriver& d = **o.driver;
  const Bytes data = pattern(4096, 5);
  ASSERT_TRUE(run_now(d.write(0, data)));
  ASSERT_TRUE(run_now(d.flush()));
  const Bytes flushed = o.file->content();
  const uint64_t footer = flushed.size() - 512;
  ASSERT_EQ(footer % kQemuAlign, 0u) << "the first block does not end on a 64 KiB boundary";
  ASSERT_TRUE(std::equal(flushed.begin(), flushed.begin() + 512, flushed.end() - 512)) << "no footer at the end";
  ASSERT_TRUE(run_now(d.write(3 * kQemuBlock, data)));
  ASSERT_TRUE(run_now(d.close()));
  const Bytes after = o.file->content();
  const uint64_t bitmap = footer + kQemuAlign - 512;
  EXPECT_EQ(load_be32(after.data() + kQemuBatAt + 12), bitmap / 512);
  EXPECT_TRUE(all_are(std::span(after).subspan(footer, kQemuAlign - 512), std::byte{0})) << "the old footer is left";
  EXPECT_TRUE(std::equal(data.begin(), data.end(), after.begin() + static_cast<std::ptrdiff_t>(bitmap + 512)));
  Bytes want(8 * kMiB);
  std::copy(data.begin(), data.end(), want.begin());
  std::copy(data.begin(), data.end(), want.begin() + static_cast<std::ptrdiff_t>(3 * kQemuBlock));
  EXPECT_TRUE(q.qemu_reads(after) == want);
}

// The request and the bitmaps of blocks 2..4 are one host write; block 1's
// bitmap goes out on its own, since the 100 bytes between it and the request
// are fresh space that reads as zeros and is not written.
TEST(VpcWrite, ARequestOverSeveralNewBlocksIsOneHostWriteAfterTheFirstBitmap) {
  auto o = open(built_image({}), true);
  ASSERT_TRUE(o.driver) << o.driver.status().to_string();
  BlockDriver& d = **o.driver;
  const Bytes data = pattern(3 * kBlock + 1000, 9);  // blocks 1..4, the first and last in part
  const uint64_t writes = o.file->counters().writes;
  ASSERT_TRUE(run_now(d.write(kBlock + 100, data)));
  EXPECT_EQ(o.file->counters().writes - writes, 2u);
  ASSERT_TRUE(run_now(d.close()));
  const Bytes img = o.file->content();
  for (uint32_t i = 0; i < 4; ++i) {
    const uint64_t at = new_bitmap_at(kDataAt) + i * kNewStride;
    EXPECT_EQ(load_be32(img.data() + kBatAt + 4 * (1 + i)), at / 512) << i;
    EXPECT_TRUE(all_are(std::span(img).subspan(at, 512), std::byte{0xff})) << "bitmap of block " << 1 + i;
  }
  EXPECT_TRUE(all_are(std::span(img).subspan(new_bitmap_at(kDataAt) + 512, 100), std::byte{0})) << "copy-on-write head";
  EXPECT_EQ(img.size(), new_bitmap_at(kDataAt) + 3 * kNewStride + kStride + 512);
  auto again = open(img, false);
  ASSERT_TRUE(again.driver);
  Bytes back(data.size());
  ASSERT_TRUE(run_now((*again.driver)->read(kBlock + 100, back)));
  EXPECT_TRUE(back == data);
  Bytes tail(kBlock * 5 - (kBlock + 100 + data.size()));
  ASSERT_TRUE(run_now((*again.driver)->read(kBlock + 100 + data.size(), tail)));
  EXPECT_TRUE(all_are(tail, std::byte{0})) << "copy-on-write tail";
}

TEST(VpcWrite, InPlaceWritesAndZeroingBesideANewBlock) {
  auto o = open(built_image({5, 0xFFFFFFFF, 14}), true);  // blocks 0 and 2 allocated (4 + 9 = 13 sectors apart)
  ASSERT_TRUE(o.driver) << o.driver.status().to_string();
  BlockDriver& d = **o.driver;
  const Bytes before = o.file->content();
  const Bytes data = pattern(2 * kBlock + 512, 1);  // blocks 0..2: the unallocated block 1 goes at the end
  ASSERT_TRUE(run_now(d.write(0, data)));
  ASSERT_TRUE(run_now(d.write_zeroes(2 * kBlock, 512, true)));
  ASSERT_TRUE(run_now(d.close()));
  const Bytes img = o.file->content();
  EXPECT_EQ(load_be32(img.data() + kBatAt), 5u);
  EXPECT_EQ(load_be32(img.data() + kBatAt + 8), 14u);
  EXPECT_EQ(load_be32(img.data() + kBatAt + 4), new_bitmap_at(before.size() - 512) / 512);
  EXPECT_TRUE(std::equal(before.begin(), before.begin() + 512, img.end() - 512));
  auto again = open(img, false);
  ASSERT_TRUE(again.driver);
  Bytes back(3 * kBlock);
  ASSERT_TRUE(run_now((*again.driver)->read(0, back)));
  EXPECT_TRUE(std::equal(data.begin(), data.begin() + 2 * kBlock, back.begin()));
  EXPECT_TRUE(all_are(std::span(back).subspan(2 * kBlock, 512), std::byte{0}));
  EXPECT_TRUE(all_are(std::span(back).subspan(2 * kBlock + 512), std::byte{0x12}));
}

TEST(VpcWrite, NoResize) {
  auto o = open(built_image({}), true);
  ASSERT_TRUE(o.driver);
  EXPECT_EQ(run_now((*o.driver)->truncate(kBlocks * kBlock + kBlock)).code(), EINVAL);
  EXPECT_EQ(run_now((*o.driver)->truncate(kBlock)).code(), EINVAL);
}

// Each refused writable open leaves the image's bytes alone, and the image
// still opens read-only.
void expect_refused(const Bytes& img, int code, const std::string& words) {
  auto o = open(img, true);
  ASSERT_FALSE(o.driver) << words;
  EXPECT_EQ(o.driver.status().code(), code) << o.driver.status().to_string();
  EXPECT_NE(o.driver.status().message().find(words), std::string::npos) << o.driver.status().message();
  EXPECT_NE(o.driver.status().message().find("read-only"), std::string::npos) << o.driver.status().message();
  EXPECT_TRUE(o.file->content() == img) << words;
  EXPECT_EQ(o.file->counters().writes, 0u);
  auto ro = open(img, false);
  EXPECT_TRUE(ro.driver) << words << ": " << ro.driver.status().to_string();
}

TEST(VpcWriteRefusals, DifferencingAndOtherDiskTypes) {
  expect_refused(built_image({4}, 4), EROFS, "differencing");
  expect_refused(built_image({4}, 0), EROFS, "neither fixed nor dynamic");
}

TEST(VpcWriteRefusals, BlocksOverMetadataOrEachOther) {
  expect_refused(built_image({0}, 3, false), EIO, "the footer copy at 0x0 overlaps block 0 at 0x0");
  expect_refused(built_image({1}, 3, false), EIO, "the dynamic disk header at 0x200 overlaps block 0 at 0x200");
  expect_refused(built_image({3}, 3, false), EIO, "the BAT at 0x600 overlaps block 0 at 0x600");
  expect_refused(built_image({0xFFFFFFFF, 4, 8}), EIO, "block 2 at 0x1000 overlaps block 1 at 0x800");
}

TEST(VpcWriteRefusals, BatOverTheHeader) {
  Bytes img = built_image({4});
  std::copy_n(img.begin() + kBatAt, 4 * kBlocks, img.begin() + 1024);  // the header's reserved bytes
  store_be64(img.data() + 512 + 16, 1024);
  expect_refused(img, EIO, "the BAT at 0x400 overlaps the dynamic disk header at 0x200");
}

TEST(VpcWriteRefusals, HeaderWhereNewBlocksGo) {
  // The dynamic-disk header moved after the last block: a new block would overwrite it.
  Bytes img = built_image({4});
  const uint64_t at = img.size() - 512;
  img.resize(img.size() + 1024);
  put_header(img, at);
  put_footer(img, 0, 3, at);
  put_footer(img, img.size() - 512, 3, at);
  expect_refused(img, EIO, "lies where new blocks go");
}

TEST(VpcWriteRefusals, BlockReachingIntoTheEndFooter) {
  Bytes img = built_image({4});
  img.resize(img.size() - 256);  // truncated: the last block ends 256 bytes before the end
  expect_refused(img, EIO, "reaches into the end footer");
}

// On a block device a new 2 MiB block's data is only 4 KiB-aligned (64 KiB
// would take 3% of its capacity): the block fits in 4 KiB of room before it.
TEST(VpcWrite, OnABlockDeviceNewBlocksAre4KiBAligned) {
  QemuImage q(8 * kMiB);
  Bytes img = q.bytes();
  const uint64_t bitmap = new_bitmap_at(img.size() - 512);  // the next 4 KiB boundary, then 3.5 KiB of padding
  img.resize(bitmap + 512 + kQemuBlock + 512 + 1000, std::byte{0x77});  // room for one block and its footer
  auto o = open(img, true, true);
  ASSERT_TRUE(o.driver) << o.driver.status().to_string();
  const Bytes data = pattern(4096, 7);
  ASSERT_TRUE(run_now((*o.driver)->write(kQemuBlock + 8192, data)));
  ASSERT_TRUE(run_now((*o.driver)->close()));
  const Bytes out = o.file->content();
  ASSERT_EQ(out.size(), img.size());
  EXPECT_EQ(load_be32(out.data() + kQemuBatAt + 4), bitmap / 512);
  EXPECT_TRUE(all_are(std::span(out).subspan(bitmap - 3584, 3584), std::byte{0})) << "the padding";
  EXPECT_TRUE(all_are(std::span(out).subspan(bitmap, 512), std::byte{0xff})) << "the bitmap";
  auto again = open(out, false);
  ASSERT_TRUE(again.driver) << again.driver.status().to_string();
  Bytes back(kQemuBlock);
  ASSERT_TRUE(run_now((*again.driver)->read(kQemuBlock, back)));
  EXPECT_TRUE(all_are(std::span(back).first(8192), std::byte{0})) << "old device bytes show through the head";
  EXPECT_TRUE(std::equal(data.begin(), data.end(), back.begin() + 8192));
  EXPECT_TRUE(all_are(std::span(back).subspan(8192 + 4096), std::byte{0})) << "old device bytes show through the tail";
}

TEST(VpcWrite, BlockDeviceGivesEnospcWhenFullAndGrowsInsideOtherwise) {
  Bytes img = built_image({4});
  const uint64_t old_end = img.size() - 512;
  auto full = open(img, true, true);
  ASSERT_TRUE(full.driver) << full.driver.status().to_string();
  const Bytes data = pattern(512, 5);
  EXPECT_EQ(run_now((*full.driver)->write(3 * kBlock, data)).code(), ENOSPC);
  ASSERT_TRUE(run_now((*full.driver)->write(0, data)));  // in place: fine
  ASSERT_TRUE(run_now((*full.driver)->close()));
  Bytes want = img;
  std::copy(data.begin(), data.end(), want.begin() + static_cast<std::ptrdiff_t>(4 * 512 + 512));
  EXPECT_TRUE(full.file->content() == want);

  img.resize(new_bitmap_at(old_end) + kStride + 512 + 1000, std::byte{0x77});  // room for one block and its footer
  auto room = open(img, true, true);
  ASSERT_TRUE(room.driver) << room.driver.status().to_string();
  ASSERT_TRUE(run_now((*room.driver)->write(3 * kBlock + 512, data)));
  EXPECT_EQ(run_now((*room.driver)->write(5 * kBlock, data)).code(), ENOSPC);
  ASSERT_TRUE(run_now((*room.driver)->close()));
  const Bytes out = room.file->content();
  ASSERT_EQ(out.size(), img.size());
  EXPECT_EQ(load_be32(out.data() + kBatAt + 12), new_bitmap_at(old_end) / 512);
  EXPECT_TRUE(std::equal(out.begin(), out.begin() + 512,
                         out.begin() + static_cast<std::ptrdiff_t>(new_bitmap_at(old_end) + kStride)));
  auto again = open(out, false);
  ASSERT_TRUE(again.driver);
  Bytes back(kBlock);
  ASSERT_TRUE(run_now((*again.driver)->read(3 * kBlock, back)));
  EXPECT_TRUE(all_are(std::span(back).first(512), std::byte{0})) << "old device bytes show through the head";
  EXPECT_TRUE(std::equal(data.begin(), data.end(), back.begin() + 512));
  EXPECT_TRUE(all_are(std::span(back).subspan(1024), std::byte{0})) << "old device bytes show through the tail";
}

// A crash after the data write and before the footer: the bitmap of a block no
// entry names lies over the old end footer. QEMU and qcowfs open it (the
// footer copy at 0 is read first); the next block goes there again (from the
// next 4 KiB boundary on) and the stale bytes do not show.
TEST(VpcWrite, CrashLeftoversAreWrittenOverWithoutShowing) {
  Bytes img = built_image({4});
  const uint64_t old_end = img.size() - 512;
  img.resize(old_end + kStride + 512);
  std::fill(img.begin() + static_cast<std::ptrdiff_t>(old_end), img.end(), std::byte{0x99});  // orphan, no footer
  auto o = open(img, true);
  ASSERT_TRUE(o.driver) << o.driver.status().to_string();
  const Bytes data = pattern(1024, 2);
  ASSERT_TRUE(run_now((*o.driver)->write(2 * kBlock + 1024, data)));
  ASSERT_TRUE(run_now((*o.driver)->close()));
  const Bytes out = o.file->content();
  EXPECT_EQ(load_be32(out.data() + kBatAt + 8), new_bitmap_at(old_end) / 512);
  EXPECT_TRUE(std::equal(out.begin(), out.begin() + 512,
                         out.begin() + static_cast<std::ptrdiff_t>(new_bitmap_at(old_end) + kStride)));
  auto again = open(out, false);
  ASSERT_TRUE(again.driver);
  Bytes back(kBlock);
  ASSERT_TRUE(run_now((*again.driver)->read(2 * kBlock, back)));
  EXPECT_TRUE(all_are(std::span(back).first(1024), std::byte{0}));
  EXPECT_TRUE(std::equal(data.begin(), data.end(), back.begin() + 1024));
  EXPECT_TRUE(all_are(std::span(back).subspan(2048), std::byte{0}));
}

// A power loss at each flush of a writeback (before the metadata, between the
// footer and the BAT, before the last one): every image the host could hold
// opens in QEMU (no BAT entry names a block past the end of the file) and in
// qcowfs read-write, and reads the old bytes or the new ones.
TEST(VpcWrite, EveryFlushOfAWritebackCanBeCutShort) {
  QemuImage q(8 * kMiB);
  const Bytes data = pattern(4096, 6);
  for (uint64_t nth = 1; nth <= 3; ++nth) {
    io::MemFileOptions mo;
    mo.track_unflushed = true;
    io::MemFile file(mo, q.bytes());
    ImageOptions opts;
    opts.file.writable = true;
    auto d = run_now(open_vpc(std::make_unique<Borrowed>(file), "t.vhd", opts));
    ASSERT_TRUE(d) << d.status().to_string();
    ASSERT_TRUE(run_now((*d)->write(3 * kMiB + 8192, data)));  // into a new block: its tail is left a hole
    file.fail_nth(io::OpKind::flush, nth, EIO);
    EXPECT_FALSE(run_now((*d)->flush())) << "flush " << nth;
    for (uint64_t seed = 0; seed < 6; ++seed) {
      const Bytes crash = file.crash_image(seed * 31 + nth);
      const Bytes got = q.qemu_reads(crash);
      ASSERT_EQ(got.size(), 8 * kMiB) << "flush " << nth << ", seed " << seed;
      const auto at = got.begin() + static_cast<std::ptrdiff_t>(3 * kMiB + 8192);
      EXPECT_TRUE(std::equal(data.begin(), data.end(), at) || all_are({&*at, data.size()}, std::byte{0}))
          << "flush " << nth << ", seed " << seed;
      auto again = open(crash, true);
      EXPECT_TRUE(again.driver) << again.driver.status().to_string();
    }
    file.clear_faults();
    ASSERT_TRUE(run_now((*d)->close()));
  }
}

TEST(VpcWrite, QemuReadsAnImageWhoseEndFooterIsClobbered) {
  QemuImage q(8 * kMiB);
  auto o = open(q.bytes(), true);
  ASSERT_TRUE(o.driver);
  const Bytes data = pattern(8192, 4);
  ASSERT_TRUE(run_now((*o.driver)->write(4 * kMiB, data)));
  ASSERT_TRUE(run_now((*o.driver)->close()));
  Bytes img = o.file->content();
  std::fill(img.end() - 512, img.end(), std::byte{0x55});
  Bytes want(8 * kMiB);
  std::copy(data.begin(), data.end(), want.begin() + static_cast<std::ptrdiff_t>(4 * kMiB));
  EXPECT_TRUE(q.qemu_reads(img) == want);
  auto again = open(img, true);  // the next block goes over the clobbered footer
  ASSERT_TRUE(again.driver) << again.driver.status().to_string();
  ASSERT_TRUE(run_now((*again.driver)->write(0, data)));
  ASSERT_TRUE(run_now((*again.driver)->close()));
  std::copy(data.begin(), data.end(), want.begin());
  EXPECT_TRUE(q.qemu_reads(again.file->content()) == want);
}

// Where built_image() puts block i's sector bitmap, given its sector.
uint64_t bitmap_at(uint32_t sector) { return uint64_t{sector} * 512; }

// Blocks whose sector bitmaps have bits clear (as another tool may leave
// them): reads change nothing; the first write into a block makes its bitmap
// all ones, flushed before the data is written (QEMU's bdrv_pwrite_sync in
// get_image_offset(..., write=true)); later writes into it, and writes into a
// block whose sectors' bits are all set (its padding bits aside), write only
// their data. Zeroing writes into a block too.
TEST(VpcWrite, TheFirstWriteIntoABlockMakesItsSectorBitmapAllOnesDurably) {
  Bytes img = built_image({4, 13, 22});
  img[bitmap_at(4)] = std::byte{0x0f};   // block 0: sectors 0-3 not present
  img[bitmap_at(13)] = std::byte{0x00};  // block 1: no sector present
  std::fill_n(img.begin() + static_cast<std::ptrdiff_t>(bitmap_at(22) + 1), 511, std::byte{0});  // block 2: padding
  auto o = open(img, true, false, true);
  ASSERT_TRUE(o.driver) << o.driver.status().to_string();
  BlockDriver& d = **o.driver;
  Bytes back(3 * kBlock);
  ASSERT_TRUE(run_now(d.read(0, back)));
  EXPECT_TRUE(o.file->content() == img);
  EXPECT_EQ(o.file->counters().writes, 0u);

  const Bytes data = pattern(512, 7);
  ASSERT_TRUE(run_now(d.write(1024, data)));
  EXPECT_EQ(o.file->counters().writes, 2u);  // the bitmap, then the data
  EXPECT_EQ(o.file->counters().flushes, 1u);
  const Bytes durable = o.file->durable_content();
  EXPECT_TRUE(all_are(std::span(durable).subspan(bitmap_at(4), 512), std::byte{0xff}))
      << "the bitmap is not durable before the data";
  EXPECT_TRUE(all_are(std::span(durable).subspan(bitmap_at(4) + 512 + 1024, 512), std::byte{0x10}));

  ASSERT_TRUE(run_now(d.write(2048, data)));              // block 0 again
  ASSERT_TRUE(run_now(d.write(2 * kBlock + 100, data)));  // block 2: its sectors' bits are set
  EXPECT_EQ(o.file->counters().writes, 4u);
  EXPECT_EQ(o.file->counters().flushes, 1u);

  ASSERT_TRUE(run_now(d.write_zeroes(kBlock + 512, 1024, false)));  // block 1
  EXPECT_EQ(o.file->counters().flushes, 2u);
  const Bytes durable2 = o.file->durable_content();
  EXPECT_TRUE(all_are(std::span(durable2).subspan(bitmap_at(13), 512), std::byte{0xff}));
  ASSERT_TRUE(run_now(d.close()));
  const Bytes out = o.file->content();
  EXPECT_TRUE(std::equal(img.begin() + static_cast<std::ptrdiff_t>(bitmap_at(22)),
                         img.begin() + static_cast<std::ptrdiff_t>(bitmap_at(22) + 512),
                         out.begin() + static_cast<std::ptrdiff_t>(bitmap_at(22))))
      << "an all-ones bitmap was rewritten";
  auto again = open(out, false);
  ASSERT_TRUE(again.driver);
  ASSERT_TRUE(run_now((*again.driver)->read(0, back)));
  EXPECT_TRUE(std::equal(data.begin(), data.end(), back.begin() + 1024));
  EXPECT_TRUE(std::equal(data.begin(), data.end(), back.begin() + 2048));
  EXPECT_TRUE(all_are(std::span(back).subspan(kBlock + 512, 1024), std::byte{0}));
  EXPECT_TRUE(all_are(std::span(back).subspan(kBlock, 512), std::byte{0x11}));
}

// A request over an existing block with clear bits and a new block: the
// existing block's bitmap is rewritten under the allocation lock, before the
// request's host writes.
TEST(VpcWrite, ARequestThatAllocatesTooRewritesTheBitmapOfItsExistingBlock) {
  Bytes img = built_image({4});
  img[bitmap_at(4)] = std::byte{0x01};
  auto o = open(img, true);
  ASSERT_TRUE(o.driver) << o.driver.status().to_string();
  const Bytes data = pattern(1024, 3);
  ASSERT_TRUE(run_now((*o.driver)->write(kBlock - 512, data)));
  ASSERT_TRUE(run_now((*o.driver)->close()));
  const Bytes out = o.file->content();
  EXPECT_TRUE(all_are(std::span(out).subspan(bitmap_at(4), 512), std::byte{0xff}));
  const uint32_t new_block = load_be32(out.data() + kBatAt + 4);
  EXPECT_TRUE(all_are(std::span(out).subspan(bitmap_at(new_block), 512), std::byte{0xff}));
  auto again = open(out, false);
  ASSERT_TRUE(again.driver);
  Bytes back(data.size());
  ASSERT_TRUE(run_now((*again.driver)->read(kBlock - 512, back)));
  EXPECT_TRUE(back == data);
}

// The same with qemu-img's image (2 MiB blocks, a 512-byte bitmap): QEMU
// reads what we wrote, and our write leaves the bitmap as QEMU's would.
TEST(VpcWrite, QemuImageBlockWithClearBitsGetsAnAllOnesBitmap) {
  QemuImage q(8 * kMiB);
  Bytes img = q.bytes();
  const uint64_t end = img.size() - 512;  // a new block goes where the footer is: build one by hand
  img.resize(end + 512 + kQemuBlock + 512);
  std::copy_n(img.begin(), 512, img.end() - 512);                                  // the footer at the new end
  std::fill_n(img.begin() + static_cast<std::ptrdiff_t>(end), 512, std::byte{0});  // bitmap: nothing present
  std::fill_n(img.begin() + static_cast<std::ptrdiff_t>(end + 512), kQemuBlock, std::byte{0x42});
  store_be32(img.data() + kQemuBatAt + 4, static_cast<uint32_t>(end / 512));  // block 1
  auto o = open(img, true);
  ASSERT_TRUE(o.driver) << o.driver.status().to_string();
  const Bytes data = pattern(4096, 8);
  ASSERT_TRUE(run_now((*o.driver)->write(kQemuBlock + 8192, data)));
  ASSERT_TRUE(run_now((*o.driver)->close()));
  const Bytes after = o.file->content();
  EXPECT_TRUE(all_are(std::span(after).subspan(end, 512), std::byte{0xff}));
  Bytes want(8 * kMiB);
  std::fill_n(want.begin() + static_cast<std::ptrdiff_t>(kQemuBlock), kQemuBlock, std::byte{0x42});
  std::copy(data.begin(), data.end(), want.begin() + static_cast<std::ptrdiff_t>(kQemuBlock + 8192));
  EXPECT_TRUE(q.qemu_reads(after) == want);
}

}  // namespace
}  // namespace qcowfs::image
