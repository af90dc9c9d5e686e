// compress=on through the qcow2 driver over an in-memory file: which clusters
// are stored compressed, how the streams are packed (byte after byte, one host
// write per request), what an overwrite does, and qemu-img check and compare
// as the referee.
#include <gtest/gtest.h>

#include <random>

#include "image/endian.h"
#include "image/qcow2/driver.h"
#include "image/qcow2/format.h"
#include "image/qcow2/l2.h"
#include "image/qcow2/qcow2.h"
#include "io/mem_file.h"
#include "unit/qcow2/qcow2_write_test_util.h"

namespace qcowfs::image::qcow2 {
namespace {

using testing::RecordingFile;
using testing::TempImage;
using Bytes = std::vector<std::byte>;

constexpr uint64_t kCluster = 65536;

// Text-like bytes: words from a small vocabulary (compress to about a third).
Bytes text(size_t n, uint32_t seed) {
  static const char* const words[] = {"qcow2 ", "cluster ", "refcount ", "table ", "the ", "of ", "guest ",
                                      "host ", "compressed ", "stream ", "\n", "sector ", "entry "};
  std::mt19937 rng(seed);
  Bytes b;
  b.reserve(n);
  while (b.size() < n) {
    const char* w = words[rng() % std::size(words)];
    for (const char* p = w; *p && b.size() < n; ++p) b.push_back(std::byte(static_cast<uint8_t>(*p)));
  }
  return b;
}

Bytes noise(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  Bytes b(n);
  for (auto& x : b) x = std::byte(static_cast<uint8_t>(rng()));
  return b;
}

class Qcow2CompressWrite : public ::testing::Test {
 protected:
  void SetUp() override { engine_ = std::move(*io::make_engine(io::EngineKind::threads)); }
  template <typename T>
  T run(Task<T> t) { return io::run_sync(*engine_, std::move(t)); }

  void open(const std::string& options, const std::string& size) {
    img_ = std::make_unique<TempImage>("cw", options, size);
    ASSERT_TRUE(img_->error().empty()) << img_->error();
    reopen(testing::read_file(img_->path()));
  }
  void reopen(Bytes bytes) {
    auto mem = std::make_unique<io::MemFile>(io::MemFileOptions{}, std::move(bytes));
    mem_ = mem.get();
    auto rec = std::make_unique<RecordingFile>(std::move(mem));
    rec_ = rec.get();
    ImageOptions o;
    o.file.writable = true;
    o.compress_writes = true;
    auto d = run(open_qcow2(std::move(rec), img_->path(), o));
    ASSERT_TRUE(d) << d.status().to_string();
    drv_ = std::move(*d);
  }
  void write(uint64_t off, const Bytes& b) {
    ASSERT_TRUE(run(drv_->write(off, b))) << "write at " << off;
    if (expect_.size() < off + b.size()) expect_.resize(off + b.size());
    std::copy(b.begin(), b.end(), expect_.begin() + static_cast<ptrdiff_t>(off));
  }
  // Closes, saves the image and checks it with qemu-img against expect_.
  void close_and_verify() {
    ASSERT_TRUE(run(drv_->close()));
    testing::write_file(img_->path(), mem_->content());
    auto check = testing::qemu_img_check(img_->path());
    EXPECT_EQ(check.status, 0) << check.output;
    const std::string raw = img_->path() + ".raw";
    Bytes padded = expect_;
    padded.resize(static_cast<size_t>(disk_size_));
    testing::write_file(raw, padded);
    std::string out;
    EXPECT_EQ(testing::shell("qemu-img compare -U -f qcow2 -F raw " + img_->path() + " " + raw, &out), 0) << out;
    ::unlink(raw.c_str());
  }
  // The L2 entry of guest cluster gc in the saved image (the first L2 table).
  uint64_t l2_entry(uint64_t gc) {
    const Bytes img = mem_->content();
    const uint64_t l1 = load_be64(img.data() + 40);
    const uint64_t l2 = load_be64(img.data() + l1) & kL1OffsetMask;
    const size_t esz = extended_ ? kExtendedL2EntrySize : kL2EntrySize;
    return load_be64(img.data() + l2 + gc * esz);
  }
  uint64_t l2_bitmap(uint64_t gc) {
    const Bytes img = mem_->content();
    const uint64_t l1 = load_be64(img.data() + 40);
    const uint64_t l2 = load_be64(img.data() + l1) & kL1OffsetMask;
    return load_be64(img.data() + l2 + gc * kExtendedL2EntrySize + kExtendedL2BitmapOffset);
  }
  static bool compressed(uint64_t entry) { return (entry & kOflagCompressed) != 0; }
  size_t host_writes() const {
    size_t n = 0;
    for (const auto& e : rec_->events()) n += e.op == RecordingFile::Op::write ? 1 : 0;
    return n;
  }

  std::unique_ptr<io::Engine> engine_;
  std::unique_ptr<TempImage> img_;
  io::MemFile* mem_ = nullptr;
  RecordingFile* rec_ = nullptr;
  std::unique_ptr<BlockDriver> drv_;
  Bytes expect_;
  uint64_t disk_size_ = 8ull << 20;
  bool extended_ = false;
};

// A 1 MiB request of text: 16 compressed streams packed byte after byte in
// one host write; random and partial clusters stored as clusters.
TEST_F(Qcow2CompressWrite, WholeClustersIntoUnallocatedSpaceAreCompressedAndPacked) {
  open("cluster_size=65536", "8M");
  write(100 * kCluster / 2, text(512, 10));  // creates the L2 table: the next request writes only data
  rec_->clear();
  write(0, text(16 * kCluster, 1));
  EXPECT_EQ(host_writes(), 1u) << "one host write for the request's 16 streams";
  write(16 * kCluster, noise(kCluster, 2));       // does not shrink
  write(20 * kCluster + 4096, text(8192, 3));     // partial cluster
  write(24 * kCluster, Bytes(2 * kCluster));      // zeros: whole clusters, compressed
  close_and_verify();
  HostOffset end = 0;
  for (uint64_t gc = 0; gc < 16; ++gc) {
    const uint64_t e = l2_entry(gc);
    ASSERT_TRUE(compressed(e)) << "cluster " << gc;
    EXPECT_EQ(e & kOflagCopied, 0u);
    const CompressedCluster c = decode_compressed(16, e);
    if (gc > 0) {
      // Packed: the stream starts where the previous one ended, inside (or
      // at the end of) the last sector the previous descriptor records.
      EXPECT_GT(c.host_offset, end - kCompressedSectorSize) << "cluster " << gc;
      EXPECT_LE(c.host_offset, end) << "cluster " << gc;
    }
    end = c.host_offset + c.size;
  }
  EXPECT_LT(end - decode_compressed(16, l2_entry(0)).host_offset, 8 * kCluster) << "text shrinks to under half";
  EXPECT_FALSE(compressed(l2_entry(16)));
  EXPECT_NE(l2_entry(16) & kOflagCopied, 0u);
  EXPECT_FALSE(compressed(l2_entry(20)));
  EXPECT_TRUE(compressed(l2_entry(24)));
  EXPECT_TRUE(compressed(l2_entry(25)));
}

// Overwrites of compressed clusters, whole or partial, are stored as
// ordinary clusters (copy-on-write from the stream), also after a reopen.
TEST_F(Qcow2CompressWrite, OverwritesOfCompressedClustersAreNotCompressed) {
  open("cluster_size=65536", "8M");
  write(0, text(8 * kCluster, 4));
  ASSERT_TRUE(run(drv_->close()));
  reopen(mem_->content());
  write(kCluster, text(kCluster, 5));
  write(3 * kCluster + 100, text(300, 6));
  write(8 * kCluster, text(kCluster, 7));  // new space in the new session: compressed
  close_and_verify();
  EXPECT_TRUE(compressed(l2_entry(0)));
  EXPECT_FALSE(compressed(l2_entry(1)));
  EXPECT_TRUE(compressed(l2_entry(2)));
  EXPECT_FALSE(compressed(l2_entry(3)));
  EXPECT_TRUE(compressed(l2_entry(8)));
}

TEST_F(Qcow2CompressWrite, ZstdExtendedL2AndTheLastPartialCluster) {
  disk_size_ = 8 * kCluster + 1024;
  extended_ = true;
  open("cluster_size=65536,extended_l2=on,compression_type=zstd", std::to_string(disk_size_));
  write(0, text(6 * kCluster, 8));
  write(8 * kCluster, text(1024, 9));  // the whole last cluster, up to the disk's end
  close_and_verify();
  for (uint64_t gc : {0u, 5u, 8u}) {
    EXPECT_TRUE(compressed(l2_entry(gc))) << "cluster " << gc;
    EXPECT_EQ(l2_bitmap(gc), 0u) << "cluster " << gc << ": compressed entries have an all-zero bitmap";
  }
}

}  // namespace
}  // namespace qcowfs::image::qcow2
