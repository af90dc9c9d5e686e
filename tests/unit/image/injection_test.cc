// Failure injection through the image drivers over MemFile fault plans: a host
// error at each kind of I/O (data read, L2 load, compressed cluster read, data
// write, flush) reaches the caller as that errno, leaves the host bytes as
// they were, and does not stop other ranges (or a retry) from working.
#include <gtest/gtest.h>

#include "image/qcow2/qcow2.h"
#include "image/raw/raw.h"
#include "io/engine.h"
#include "io/mem_file.h"
#include "io/run_sync.h"
#include "unit/qcow2/qcow2_test_util.h"

namespace qcowfs::image {
namespace {

using Bytes = std::vector<std::byte>;
constexpr uint64_t kMiB = 1 << 20;

Bytes filled(size_t n, uint8_t v) { return Bytes(n, std::byte{v}); }

class Injection : public qcow2::testing::QemuImageTest {
 protected:
  Injection() : QemuImageTest("qcowfs_injection_test", io::EngineKind::threads) {}

  // Builds i.qcow2 with shell commands and opens it from a read-only MemFile
  // with a small L2 cache (4 KiB slices).
  void make_qcow2(const std::string& commands) {
    auto file = build_image(commands);
    ASSERT_FALSE(HasFailure());
    mem_ = file.get();
    ImageOptions opts;
    opts.table_cache_size = 8192;  // two slices: L2 loads happen often
    auto d = io::run_sync(*engine_, open_qcow2(std::move(file), image_path(), opts));
    ASSERT_TRUE(d.is_ok()) << d.status().to_string();
    driver_ = std::move(*d);
  }

  void make_raw(uint64_t size) {
    auto file = std::make_unique<io::MemFile>(io::MemFileOptions{}, filled(size, 0x11));
    mem_ = file.get();
    driver_ = std::make_unique<RawDriver>(std::move(file), false);
  }

  Status read(uint64_t off, Bytes& buf) { return io::run_sync(*engine_, driver_->read(off, buf)); }
  Status write(uint64_t off, const Bytes& buf) { return io::run_sync(*engine_, driver_->write(off, buf)); }
  Status flush() { return io::run_sync(*engine_, driver_->flush()); }

  // Reads [off, off+n) and checks it is all `v`.
  void expect_reads(uint64_t off, size_t n, uint8_t v) {
    Bytes buf(n);
    Status st = read(off, buf);
    ASSERT_TRUE(st.is_ok()) << "at " << off << ": " << st.to_string();
    EXPECT_EQ(buf, filled(n, v)) << "at " << off;
  }

  io::MemFile* mem_ = nullptr;
};

constexpr const char* kTwoRegions =
    "qemu-img create -q -f qcow2 -o cluster_size=4096 i.qcow2 16M && "
    "qemu-io -f qcow2 -c 'write -P 1 0 1M' -c 'write -P 2 8M 1M' i.qcow2";

TEST_F(Injection, DataReadErrorIsEioAndOtherRangesStillRead) {
  make_qcow2(kTwoRegions);
  expect_reads(0, 4096, 1);  // warm the L2 slice of region 1
  mem_->fail_nth(io::OpKind::read, 1, EIO);
  Bytes buf(4096);
  Status st = read(4096, buf);
  EXPECT_EQ(st.code(), EIO) << st.to_string();
  expect_reads(4096, 4096, 1);  // the same range, retried
  expect_reads(8 * kMiB, 64 * 1024, 2);
  EXPECT_EQ(mem_->counters().writes, 0u);
}

TEST_F(Injection, L2LoadErrorIsEioAndNotCached) {
  make_qcow2(kTwoRegions);
  uint64_t before = mem_->counters().reads;
  mem_->fail_nth(io::OpKind::read, 1, EIO);  // the first host read is the L2 slice
  Bytes buf(4096);
  EXPECT_EQ(read(8 * kMiB, buf).code(), EIO);
  EXPECT_EQ(mem_->counters().reads, before + 1);
  expect_reads(8 * kMiB, 4096, 2);  // reloaded, not a remembered failure
  expect_reads(0, 4096, 1);
}

TEST_F(Injection, CompressedClusterReadErrorIsEio) {
  make_qcow2("qemu-img create -q -f qcow2 i.qcow2 4M && "
             "qemu-io -f qcow2 -c 'write -c -P 7 0 64k' -c 'write -P 8 1M 64k' i.qcow2");
  expect_reads(1 * kMiB, 4096, 8);  // L2 loaded
  mem_->fail_nth(io::OpKind::read, 1, EIO);
  Bytes buf(4096);
  EXPECT_EQ(read(0, buf).code(), EIO);
  expect_reads(0, 64 * 1024, 7);
}

TEST_F(Injection, DeadDiskFailsEverythingUntilItRecovers) {
  make_qcow2(kTwoRegions);
  mem_->fail_from(io::OpKind::read, 1, EIO);
  Bytes buf(64 * 1024);
  EXPECT_EQ(read(0, buf).code(), EIO);
  EXPECT_EQ(read(8 * kMiB, buf).code(), EIO);
  mem_->clear_faults();
  expect_reads(0, 64 * 1024, 1);
  expect_reads(8 * kMiB, 64 * 1024, 2);
}

TEST_F(Injection, ShortHostReadOfMetadataIsNotTakenAsData) {
  make_qcow2(kTwoRegions);
  mem_->short_once(io::OpKind::read, 100);  // the L2 slice comes back short
  Bytes buf(4096);
  Status st = read(8 * kMiB, buf);
  if (st.is_ok()) {
    EXPECT_EQ(buf, filled(4096, 2));  // a driver may retry the rest of the slice
  } else {
    EXPECT_EQ(st.code(), EIO) << st.to_string();
  }
  expect_reads(8 * kMiB, 4096, 2);
}

TEST_F(Injection, RawWriteErrorLeavesBytesAndOtherWritesWork) {
  make_raw(4 * kMiB);
  mem_->fail_nth(io::OpKind::write, 1, EIO);
  EXPECT_EQ(write(0, filled(4096, 0x22)).code(), EIO);
  expect_reads(0, 4096, 0x11);
  ASSERT_TRUE(write(kMiB, filled(4096, 0x33)).is_ok());
  expect_reads(kMiB, 4096, 0x33);
}

TEST_F(Injection, RawFlushErrorReachesTheCallerThenRecovers) {
  make_raw(4 * kMiB);
  ASSERT_TRUE(write(0, filled(4096, 0x55)).is_ok());
  mem_->fail_nth(io::OpKind::flush, 1, EIO);
  EXPECT_EQ(flush().code(), EIO);
  EXPECT_TRUE(flush().is_ok());
  expect_reads(0, 4096, 0x55);
}

}  // namespace
}  // namespace qcowfs::image
