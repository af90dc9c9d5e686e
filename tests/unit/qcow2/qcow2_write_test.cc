// qcow2 write path through the driver over in-memory and recording files:
// read-back, the host I/O a request costs (one data write per request, no
// per-write metadata I/O or flush) and the order of host writes and flushes
// the metadata rules require, asserted on a recording HostFile.
#include <gtest/gtest.h>

#include <random>

#include "image/endian.h"
#include "image/qcow2/qcow2.h"
#include "image/qcow2/driver.h"
#include "image/qcow2/format.h"
#include "image/qcow2/writer.h"
#include "io/mem_file.h"
#include "unit/qcow2/qcow2_write_test_util.h"

namespace qcowfs::image::qcow2 {
namespace {

using testing::RecordingFile;
using testing::TempImage;
using Op = RecordingFile::Op;

std::vector<std::byte> pattern(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::byte> v(n);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  return v;
}

class Qcow2Write : public ::testing::Test {
 protected:
  void SetUp() override { engine_ = std::move(*io::make_engine(io::EngineKind::threads)); }
  template <typename T>
  T run(Task<T> t) { return io::run_sync(*engine_, std::move(t)); }

  // Opens a qemu-img image writable over a recording MemFile.
  void open(const std::string& options, const std::string& size) {
    img_ = std::make_unique<TempImage>("wr", options, size);
    ASSERT_TRUE(img_->error().empty()) << img_->error();
    open_memory(testing::read_file(img_->path()), true);
  }
  // Opens `bytes` writable over a MemFile (behind a RecordingFile if `record`),
  // as the image at img_'s path.
  void open_memory(std::vector<std::byte> bytes, bool record) {
    auto mem = std::make_unique<io::MemFile>(io::MemFileOptions{}, std::move(bytes));
    mem_ = mem.get();
    std::unique_ptr<io::HostFile> file = std::move(mem);
    if (record) {
      auto rec = std::make_unique<RecordingFile>(std::move(file));
      rec_ = rec.get();
      file = std::move(rec);
    }
    ImageOptions o;
    o.file.writable = true;
    auto d = run(open_qcow2(std::move(file), img_->path(), o));
    ASSERT_TRUE(d) << d.status().to_string();
    drv_ = std::move(*d);
    ASSERT_FALSE(drv_->read_only());
  }
  Qcow2Driver& q() { return static_cast<Qcow2Driver&>(*drv_); }
  // Saves the in-memory image to the temp path (for qemu-img).
  void save() { testing::write_file(img_->path(), mem_->content()); }
  // Saves the image and asserts `qemu-img check` finds nothing.
  void expect_qemu_check_clean() {
    save();
    auto check = testing::qemu_img_check(img_->path());
    EXPECT_EQ(check.status, 0) << check.output;
  }
  void close_and_check() {
    ASSERT_TRUE(run(drv_->close()));
    expect_qemu_check_clean();
  }
  std::vector<std::byte> read(uint64_t off, size_t n) {
    std::vector<std::byte> v(n);
    EXPECT_TRUE(run(drv_->read(off, v)));
    return v;
  }

  std::unique_ptr<io::Engine> engine_;
  std::unique_ptr<TempImage> img_;
  io::MemFile* mem_ = nullptr;
  RecordingFile* rec_ = nullptr;
  std::unique_ptr<BlockDriver> drv_;
};

TEST_F(Qcow2Write, SequentialMegabyteWritesCostOneHostWriteEach) {
  open("cluster_size=65536", "1G");
  auto data = pattern(1 << 20, 1);
  ASSERT_TRUE(run(drv_->write(0, data)));  // also creates the first L2 table
  rec_->clear();
  for (uint64_t i = 1; i < 8; ++i) {
    ASSERT_TRUE(run(drv_->write(i << 20, data)));
    auto ev = rec_->events();
    ASSERT_EQ(ev.size(), 1u) << "request " << i << " cost " << ev.size() << " host operations";
    EXPECT_EQ(ev[0].op, Op::write);
    EXPECT_EQ(ev[0].length, 1u << 20);
    rec_->clear();
  }
  EXPECT_EQ(read(5 << 20, 1 << 20), data);
  // Host-contiguous: 8 MiB of guest data occupies one 8 MiB host run.
  uint64_t l2 = q().l1_table().entries[0] & kL1OffsetMask;
  ASSERT_NE(l2, 0u);
  close_and_check();
}

TEST_F(Qcow2Write, FlushWritesDataRefcountsL2ThenL1WithFlushesBetween) {
  open("cluster_size=65536", "1G");
  auto data = pattern(100000, 2);
  rec_->clear();
  ASSERT_TRUE(run(drv_->write(70000, data)));  // partial clusters at both ends, on fresh clusters
  auto ev = rec_->events();
  ASSERT_EQ(ev.size(), 3u) << "new L2 table + host space preallocation + one data write";
  const uint64_t l2 = q().l1_table().entries[0] & kL1OffsetMask;
  EXPECT_EQ(ev[0].offset, l2);
  EXPECT_GE(ev[1].length, Qcow2Writer::kPreallocBytes) << "preallocated ahead of the small write";
  EXPECT_EQ(ev[2].length, 100000u) << "fresh clusters read as zeros: no COW written";
  const uint64_t data_off = ev[2].offset;
  rec_->clear();
  ASSERT_TRUE(run(drv_->flush()));
  ev = rec_->events();
  // Expected: refcount block(s), flush, L2 slice, flush, L1 entry, flush.
  auto first = [&](auto pred) {
    for (size_t i = 0; i < ev.size(); ++i)
      if (pred(ev[i])) return static_cast<int>(i);
    return -1;
  };
  auto last = [&](auto pred) {
    for (size_t i = ev.size(); i-- > 0;)
      if (pred(ev[i])) return static_cast<int>(i);
    return -1;
  };
  auto is_flush = [](const RecordingFile::Event& e) { return e.op == Op::flush; };
  auto in = [](uint64_t start, uint64_t len) {
    return [=](const RecordingFile::Event& e) { return e.op == Op::write && e.offset >= start && e.offset < start + len; };
  };
  const uint64_t l1 = q().l1_table().host_offset;
  int refblock_w = first([&](const RecordingFile::Event& e) {
    return e.op == Op::write && !in(l2, 65536)(e) && !in(l1, 65536)(e) && e.offset != data_off;
  });
  int l2_w = first(in(l2, 65536));
  int l1_w = first(in(l1, 65536));
  ASSERT_GE(refblock_w, 0);
  ASSERT_GE(l2_w, 0);
  ASSERT_GE(l1_w, 0);
  auto flush_between = [&](int a, int b) {
    for (int i = a + 1; i < b; ++i)
      if (ev[static_cast<size_t>(i)].op == Op::flush) return true;
    return false;
  };
  EXPECT_TRUE(flush_between(refblock_w, l2_w)) << "refcount increase durable before the L2 entry";
  EXPECT_TRUE(flush_between(-1, l2_w)) << "data durable before the L2 entry";
  EXPECT_TRUE(flush_between(l2_w, l1_w)) << "new L2 table durable before the L1 entry";
  EXPECT_EQ(last(is_flush), static_cast<int>(ev.size()) - 1) << "flush() ends with a host flush";
  // Nothing dirty: a second flush writes nothing.
  rec_->clear();
  ASSERT_TRUE(run(drv_->flush()));
  for (const auto& e : rec_->events()) EXPECT_EQ(e.op, Op::flush);
  std::vector<std::byte> want(100000);
  std::memcpy(want.data(), data.data(), data.size());
  EXPECT_EQ(read(70000, 100000), want);
  close_and_check();
}

TEST_F(Qcow2Write, FreshClusterPastTheFileEndGetsOnlyTheRequestWritten) {
  open("cluster_size=65536", "64M");
  ASSERT_TRUE(run(drv_->write(0, pattern(65536, 10))));  // creates the L2 table
  ASSERT_TRUE(run(drv_->write(65536, pattern(512, 15))));  // preallocates host space
  auto data = pattern(4096, 11);
  rec_->clear();
  ASSERT_TRUE(run(drv_->write(3 * 65536 + 8192, data)));
  auto ev = rec_->events();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].op, Op::write);
  EXPECT_EQ(ev[0].length, 4096u) << "no zero COW head or tail on a never-written cluster";
  EXPECT_EQ(ev[0].offset % 65536, 8192u);
  std::vector<std::byte> want(65536);
  std::memcpy(want.data() + 8192, data.data(), data.size());
  EXPECT_EQ(read(3 * 65536, 65536), want);
  ASSERT_TRUE(run(drv_->close()));
  EXPECT_EQ(mem_->size() % 65536, 0u) << "close trims the preallocation to whole clusters";
  EXPECT_LE(mem_->size(), ev[0].offset + 65536) << "nothing preallocated is left past the last cluster";
  expect_qemu_check_clean();
}

TEST_F(Qcow2Write, ReusedFreedClusterHoldingOldBytesStillGetsItsZeroCow) {
  open("cluster_size=65536", "64M");
  ASSERT_TRUE(run(drv_->write(0, pattern(65536, 12))));
  rec_->clear();
  ASSERT_TRUE(run(drv_->write(65536, pattern(65536, 13))));  // the cluster to free
  ASSERT_EQ(rec_->events().size(), 1u);
  const uint64_t old_host = rec_->events()[0].offset;
  ASSERT_TRUE(run(drv_->flush()));
  ASSERT_TRUE(run(drv_->discard(65536, 65536)));
  ASSERT_TRUE(run(drv_->flush()));  // frees the host cluster; its old bytes stay in the file
  auto data = pattern(4096, 14);
  rec_->clear();
  ASSERT_TRUE(run(drv_->write(7 * 65536 + 8192, data)));
  auto ev = rec_->events();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].length, 65536u) << "a reused cluster is not known to be zero: whole cluster written";
  EXPECT_EQ(ev[0].offset, old_host) << "the freed cluster was reused";
  std::vector<std::byte> want(65536);
  std::memcpy(want.data() + 8192, data.data(), data.size());
  EXPECT_EQ(read(7 * 65536, 65536), want);
  close_and_check();
}

TEST_F(Qcow2Write, RefcountDecreaseOnlyAfterTheL2UpdateIsDurable) {
  open("cluster_size=65536", "64M");
  auto data = pattern(65536, 3);
  ASSERT_TRUE(run(drv_->write(0, data)));
  ASSERT_TRUE(run(drv_->flush()));
  Qcow2Writer& w = *q().writer();
  uint64_t l2 = q().l1_table().entries[0] & kL1OffsetMask;
  (void)l2;
  // The data cluster is the one right after the L2 table written first.
  uint64_t used_before = 0;
  for (uint64_t c = 0; c < 64; ++c) used_before += *run(w.refcounts().get(c)) ? 1 : 0;
  ASSERT_TRUE(run(drv_->write_zeroes(0, 65536, true)));
  uint64_t used_mid = 0;
  for (uint64_t c = 0; c < 64; ++c) used_mid += *run(w.refcounts().get(c)) ? 1 : 0;
  EXPECT_EQ(used_mid, used_before) << "the cluster is not freed before the L2 change is on disk";
  ASSERT_TRUE(run(drv_->flush()));
  uint64_t used_after = 0;
  for (uint64_t c = 0; c < 64; ++c) used_after += *run(w.refcounts().get(c)) ? 1 : 0;
  EXPECT_EQ(used_after + 1, used_before);
  EXPECT_EQ(read(0, 65536), std::vector<std::byte>(65536));
  close_and_check();
}

TEST_F(Qcow2Write, EnospcFailsTheWriteAndLaterWritesThatFitSucceed) {
  open("cluster_size=65536", "64M");
  auto data = pattern(1 << 20, 4);
  ASSERT_TRUE(run(drv_->write(0, data)));
  mem_->set_size_limit(mem_->size() + (512 << 10));
  Status st = run(drv_->write(8 << 20, data));
  EXPECT_EQ(st.code(), ENOSPC) << st.to_string();
  ASSERT_TRUE(run(drv_->write(16 << 20, std::span<const std::byte>(data).first(256 << 10))));
  ASSERT_TRUE(run(drv_->flush()));
  mem_->clear_faults();
  EXPECT_EQ(read(0, 1 << 20), data);
  auto head = read(16 << 20, 256 << 10);
  EXPECT_TRUE(std::equal(head.begin(), head.end(), data.begin()));
  close_and_check();
}

TEST_F(Qcow2Write, GrowingPastTheL1TableMovesItWithOneHeaderWrite) {
  open("cluster_size=4096", "4M");  // 512 entries per L2: one L1 entry per 2 MiB
  auto data = pattern(4096, 5);
  ASSERT_TRUE(run(drv_->write(0, data)));
  uint64_t old_l1 = q().l1_table().host_offset;
  ASSERT_TRUE(run(drv_->truncate(64ull << 20)));
  EXPECT_EQ(drv_->size(), 64ull << 20);
  EXPECT_NE(q().l1_table().host_offset, old_l1);
  EXPECT_EQ(q().l1_table().entries.size(), 32u);
  // A single-cluster write under an existing L2 table reuses the old L1
  // table's cluster for data: not metadata any more.
  ASSERT_TRUE(run(drv_->write(8192, data)));
  EXPECT_EQ(read(8192, 4096), data);
  ASSERT_TRUE(run(drv_->write((64ull << 20) - 4096, data)));
  EXPECT_EQ(read(0, 4096), data);
  EXPECT_EQ(read((64ull << 20) - 4096, 4096), data);
  EXPECT_EQ(run(drv_->truncate(1 << 20)).code(), EINVAL);
  close_and_check();
  std::string out;
  testing::shell("qemu-img info -U " + img_->path(), &out);
  EXPECT_NE(out.find("64 MiB"), std::string::npos) << out;
}

TEST_F(Qcow2Write, RefcountTableGrowsUnderWritesAndUnderZeroes) {
  // 512-byte clusters: the one-cluster refcount table covers 8 MiB of host
  // file, an L2 table 32 KiB of guest. Zeroing over a backing file writes zero
  // flags, so it allocates L2 tables.
  constexpr uint64_t kMiB = 1 << 20;
  TempImage base("base", "", "1G");
  ASSERT_TRUE(base.error().empty()) << base.error();
  open(fmt::format("cluster_size=512,backing_file={},backing_fmt=qcow2", base.path()), "1G");
  auto table_offset = [&] { return load_be64(mem_->content().data() + offsetof(HeaderLayout, refcount_table_offset)); };
  const uint64_t initial = table_offset();
  auto data = pattern(kMiB, 11);
  for (uint64_t off = 0; off < 12 * kMiB; off += kMiB) ASSERT_TRUE(run(drv_->write(off, data)));
  const uint64_t after_writes = table_offset();
  EXPECT_NE(after_writes, initial);
  // 512 MiB of guest needs 16384 new L2 tables: 8 MiB of host file.
  ASSERT_TRUE(run(drv_->write_zeroes(256 * kMiB, 512 * kMiB, false)));
  EXPECT_NE(table_offset(), after_writes);
  EXPECT_EQ(read(5 * kMiB, data.size()), data);
  EXPECT_EQ(read(300 * kMiB, 4096), std::vector<std::byte>(4096));
  close_and_check();
}

TEST_F(Qcow2Write, CorruptMetadataFoundWhileWritingMarksTheImageCorrupt) {
  img_ = std::make_unique<TempImage>("corrupt", "cluster_size=65536", "64M");
  ASSERT_TRUE(img_->error().empty()) << img_->error();
  std::string out;
  ASSERT_EQ(testing::shell("qemu-io -f qcow2 -c 'write -P 7 0 64k' -c 'write -P 8 1M 64k' " + img_->path(), &out), 0)
      << out;
  auto bytes = testing::read_file(img_->path());
  uint64_t l1 = load_be64(bytes.data() + 40);
  uint64_t l2 = load_be64(bytes.data() + l1) & kL1OffsetMask;
  // Reserved bit 1 in the L2 entry of guest cluster 0.
  store_be64(bytes.data() + l2, load_be64(bytes.data() + l2) | 2);
  open_memory(bytes, false);
  auto data = pattern(4096, 6);
  EXPECT_EQ(run(drv_->write(0, data)).code(), EIO);
  EXPECT_EQ(run(drv_->write(8 << 20, data)).code(), EIO) << "later writes fail too";
  EXPECT_EQ(run(drv_->write_zeroes(8 << 20, 4096, true)).code(), EIO);
  EXPECT_EQ(read(1 << 20, 4096), std::vector<std::byte>(4096, std::byte{8})) << "reads elsewhere work";
  auto now = mem_->content();
  EXPECT_NE(load_be64(now.data() + 72) & kIncompatCorrupt, 0u) << "corrupt bit set on disk";
  ASSERT_TRUE(run(drv_->close()));
}

TEST_F(Qcow2Write, LazyRefcountsSetTheDirtyBitAndADirtyImageIsRebuiltOnOpen) {
  open("cluster_size=65536,lazy_refcounts=on", "64M");
  auto data = pattern(3 << 20, 9);
  ASSERT_TRUE(run(drv_->write(1 << 20, data)));
  ASSERT_TRUE(run(drv_->flush()));
  auto crashed = mem_->content();  // as if the process died here: no close
  EXPECT_NE(load_be64(crashed.data() + 72) & kIncompatDirty, 0u) << "dirty bit set before the first change";
  // Damage the refcounts further: the first refcount block says nothing is used
  // except the header.
  uint64_t reftable = load_be64(crashed.data() + 48);
  uint64_t block = load_be64(crashed.data() + reftable) & kReftableOffsetMask;
  std::memset(crashed.data() + block + 2, 0, 65536 - 2);
  ASSERT_TRUE(run(drv_->close()));
  drv_.reset();
  open_memory(crashed, false);
  EXPECT_EQ(load_be64(mem_->content().data() + 72) & kIncompatDirty, 0u) << "rebuilt and clean";
  EXPECT_EQ(read(1 << 20, 3 << 20), data);
  ASSERT_TRUE(run(drv_->write(10 << 20, data)));  // allocations do not land on used clusters
  EXPECT_EQ(read(1 << 20, 3 << 20), data);
  close_and_check();
}

TEST_F(Qcow2Write, DirtyImageWithDataPastTheFileEndIsNotOpenedWritable) {
  open("cluster_size=65536,lazy_refcounts=on", "64M");
  ASSERT_TRUE(run(drv_->write(0, pattern(65536, 10))));
  ASSERT_TRUE(run(drv_->flush()));
  auto crashed = mem_->content();  // dirty: no close
  ASSERT_TRUE(run(drv_->close()));
  drv_.reset();
  // Guest cluster 0 now maps far past the end of the file: a rebuild would
  // leave that cluster free for the next allocation.
  uint64_t l2 = load_be64(crashed.data() + load_be64(crashed.data() + 40)) & kL1OffsetMask;
  store_be64(crashed.data() + l2, (uint64_t{1} << 36) | kOflagCopied);
  ImageOptions o;
  o.file.writable = true;
  auto d = run(open_qcow2(std::make_unique<io::MemFile>(io::MemFileOptions{}, crashed), img_->path(), o));
  ASSERT_FALSE(d) << "opened writable";
  EXPECT_EQ(d.status().code(), EIO);
  EXPECT_NE(d.status().message().find("corrupt metadata"), std::string::npos) << d.status().to_string();
}

}  // namespace
}  // namespace qcowfs::image::qcow2
