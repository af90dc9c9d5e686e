// Crash consistency of the qcow2 writer: random write / zero / discard /
// flush workloads run over a MemFile that tracks unflushed host writes; at
// every flush boundary and at random points between, several power-loss
// images (unflushed writes dropped and reordered) are taken. Each must pass
// `qemu-img check` without corruption (leaks are allowed) and must hold every
// byte acknowledged before the last completed flush, read back by qemu-img.
#include <gtest/gtest.h>

#include <random>

#include "image/qcow2/qcow2.h"
#include "io/mem_file.h"
#include "unit/qcow2/qcow2_write_test_util.h"

namespace qcowfs::image::qcow2 {
namespace {

using testing::read_file;
using testing::TempImage;
using testing::write_file;

constexpr uint64_t kDisk = 8ull << 20;
constexpr uint64_t kBlock = 512;  // granularity of the "touched since the last flush" map

struct Model {
  std::vector<std::byte> now = std::vector<std::byte>(kDisk);      // what reads return
  std::vector<std::byte> durable = std::vector<std::byte>(kDisk);  // as of the last completed flush
  std::vector<bool> touched = std::vector<bool>(kDisk / kBlock);   // changed since that flush
  void change(uint64_t off, uint64_t len) {
    for (uint64_t b = off / kBlock; b <= (off + len - 1) / kBlock; ++b) touched[b] = true;
  }
  void flushed() {
    durable = now;
    std::fill(touched.begin(), touched.end(), false);
  }
};

class Qcow2Crash : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { engine_ = std::move(*io::make_engine(io::EngineKind::threads)); }
  template <typename T>
  T run(Task<T> t) { return io::run_sync(*engine_, std::move(t)); }

  // Checks one crash image: no corruption, and durable bytes intact.
  void check_crash(const std::vector<std::byte>& image, const Model& m, const std::string& where) {
    std::string path = img_->path() + ".crash";
    write_file(path, image);
    auto check = testing::qemu_img_check(path);
    EXPECT_TRUE(check.status == 0 || check.status == 3) << where << ":\n" << check.output;
    std::string raw = path + ".raw", out;
    int rc = testing::shell(fmt::format("qemu-img convert -U -f qcow2 -O raw {} {}", path, raw), &out);
    ASSERT_EQ(rc, 0) << where << ": " << out;
    auto got = read_file(raw);
    ASSERT_GE(got.size(), kDisk) << where;
    for (uint64_t b = 0; b < kDisk / kBlock; ++b) {
      if (m.touched[b]) continue;
      if (std::memcmp(got.data() + b * kBlock, m.durable.data() + b * kBlock, kBlock) != 0) {
        ADD_FAILURE() << where << ": flushed data lost at guest offset " << b * kBlock;
        break;
      }
    }
    ::unlink(path.c_str());
    ::unlink(raw.c_str());
  }

  std::unique_ptr<io::Engine> engine_;
  std::unique_ptr<TempImage> img_;
};

TEST_P(Qcow2Crash, EveryCutPointLeavesAValidImageWithFlushedDataIntact) {
  img_ = std::make_unique<TempImage>("crash", GetParam(), std::to_string(kDisk));
  ASSERT_TRUE(img_->error().empty()) << img_->error();
  io::MemFileOptions mo;
  mo.track_unflushed = true;
  auto mem = std::make_unique<io::MemFile>(mo, read_file(img_->path()));
  io::MemFile* file = mem.get();
  ImageOptions o;
  o.file.writable = true;
  auto d = run(open_qcow2(std::move(mem), img_->path(), o));
  ASSERT_TRUE(d) << d.status().to_string();
  BlockDriver& drv = **d;

  std::mt19937_64 rng(std::hash<std::string>{}(GetParam()) & 0xffff);
  Model m;
  int checks = 0;
  for (int step = 0; step < 160 / io::testing::kSanitizerScale; ++step) {
    uint64_t r = rng() % 100;
    uint64_t off = rng() % kDisk;
    uint64_t len = std::min<uint64_t>(kDisk - off, 1 + rng() % (r < 50 ? 200000 : 1500000));
    if (r < 60) {
      std::vector<std::byte> data(len);
      for (auto& b : data) b = static_cast<std::byte>(rng());
      ASSERT_TRUE(run(drv.write(off, data)));
      std::memcpy(m.now.data() + off, data.data(), len);
      m.change(off, len);
    } else if (r < 72) {
      ASSERT_TRUE(run(drv.write_zeroes(off, len, rng() % 2 == 0)));
      std::memset(m.now.data() + off, 0, len);
      m.change(off, len);
    } else if (r < 80) {
      // discard: the range may read back as anything afterwards
      ASSERT_TRUE(run(drv.discard(off, len)));
      std::vector<std::byte> now(len);
      ASSERT_TRUE(run(drv.read(off, now)));
      std::memcpy(m.now.data() + off, now.data(), len);
      m.change(off, len);
    } else {
      ASSERT_TRUE(run(drv.flush()));
      m.flushed();
      // At the flush boundary: nothing unflushed may matter.
      check_crash(file->crash_image(rng()), m, fmt::format("after flush at step {}", step));
      ++checks;
      continue;
    }
    if (step % 9 == 0) {  // between flushes, with unflushed writes dropped and reordered
      for (int k = 0; k < 2; ++k) {
        check_crash(file->crash_image(rng()), m, fmt::format("between flushes at step {} (seed {})", step, k));
        ++checks;
      }
    }
    if (::testing::Test::HasFailure()) break;
  }
  ASSERT_TRUE(run(drv.close()));
  m.flushed();
  check_crash(file->content(), m, "after close");
  EXPECT_GE(checks, 20 / io::testing::kSanitizerScale);
  // The final image is clean: no leaks either.
  write_file(img_->path(), file->content());
  auto final_check = testing::qemu_img_check(img_->path());
  EXPECT_EQ(final_check.status, 0) << final_check.output;
}

INSTANTIATE_TEST_SUITE_P(Images, Qcow2Crash,
                         ::testing::Values("cluster_size=65536", "cluster_size=4096",
                                           "cluster_size=16384,extended_l2=on", "compat=0.10,cluster_size=16384",
                                           "cluster_size=512,refcount_bits=1"),
                         [](const ::testing::TestParamInfo<std::string>& p) { return std::to_string(p.index); });

}  // namespace
}  // namespace qcowfs::image::qcow2
