// Crash consistency of persistent bitmaps (image/qcow2/DESIGN.md, "Bitmap
// write ordering"): an image with bitmaps made by qemu-img is written through
// the writer and closed over a MemFile that tracks unflushed writes; before
// every flush of the session (the IN_USE marking, write-backs, the store at
// close) a power-loss image is taken (unflushed writes dropped and reordered).
// Each must pass `qemu-img check` without corruption (leaks are allowed), and
// each bitmap in it must be marked in use (QEMU then ignores its bits), or
// hold no bits (before the first write), or hold every granule written.
#include <gtest/gtest.h>

#include "image/qcow2/bitmaps.h"
#include "image/qcow2/qcow2.h"
#include "image/qcow2/qcow2_inspect.h"
#include "io/mem_file.h"
#include "unit/image/forwarding_file.h"
#include "unit/qcow2/qcow2_write_test_util.h"

namespace qcowfs::image::qcow2 {
namespace {

using testing::read_file;
using testing::TempImage;
using testing::write_file;

constexpr uint64_t kMiB = 1 << 20, kKiB = 1 << 10;

// Takes a crash image of the MemFile before each flush.
class FlushTap final : public qcowfs::testing::ForwardingFile {
 public:
  FlushTap(std::unique_ptr<io::MemFile> f, io::MemFile& mem) : ForwardingFile(std::move(f)), mem_(mem) {}
  Task<Status> flush() override {
    images_.push_back(mem_.crash_image(images_.size()));
    return inner().flush();
  }
  const std::vector<std::vector<std::byte>>& images() const { return images_; }

 private:
  io::MemFile& mem_;
  std::vector<std::vector<std::byte>> images_;
};

class Qcow2BitmapCrash : public ::testing::Test {
 protected:
  void SetUp() override { engine_ = std::move(*io::make_engine(io::EngineKind::threads)); }
  template <typename T>
  T run(Task<T> t) { return io::run_sync(*engine_, std::move(t)); }

  // The bitmaps of an image's bytes, as the writer would load them.
  std::vector<TrackedBitmap> bitmaps_of(const std::vector<std::byte>& image) {
    io::MemFile f({}, image);
    auto h = run(read_qcow2_header(f));
    EXPECT_TRUE(h) << h.status().to_string();
    if (!h) return {};
    auto b = run(PersistentBitmaps::load(f, *h, true));
    EXPECT_TRUE(b) << b.status().to_string();
    if (!b) return {};
    return (*b)->store_set().bitmaps;
  }

  std::unique_ptr<io::Engine> engine_;
};

TEST_F(Qcow2BitmapCrash, EveryFlushLeavesBitmapsInUseEmptyOrComplete) {
  TempImage img("bmcrash", "cluster_size=65536", "8M");
  ASSERT_TRUE(img.error().empty()) << img.error();
  std::string out;
  ASSERT_EQ(testing::shell(fmt::format("qemu-img bitmap --add -f qcow2 {} b0 && "
                                       "qemu-img bitmap --add -g 128k -f qcow2 {} b1", img.path(), img.path()), &out), 0)
      << out;
  io::MemFileOptions mo;
  mo.track_unflushed = true;
  auto mem = std::make_unique<io::MemFile>(mo, read_file(img.path()));
  io::MemFile& memref = *mem;
  auto tap = std::make_unique<FlushTap>(std::move(mem), memref);
  FlushTap& t = *tap;
  ImageOptions o;
  o.file.writable = true;
  auto d = run(open_qcow2(std::move(tap), img.path(), o));
  ASSERT_TRUE(d) << d.status().to_string();
  std::vector<std::byte> data(64 * kKiB, std::byte{0x5a});
  ASSERT_TRUE(run((*d)->write(1 * kMiB, data)));
  ASSERT_TRUE(run((*d)->write_zeroes(5 * kMiB + 4 * kKiB, 4 * kKiB, false)));
  ASSERT_TRUE(run((*d)->flush()));
  ASSERT_TRUE(run((*d)->close()));

  const std::vector<DirtyRange> want0{{1 * kMiB, 64 * kKiB}, {5 * kMiB, 64 * kKiB}};
  const std::vector<DirtyRange> want1{{1 * kMiB, 128 * kKiB}, {5 * kMiB, 128 * kKiB}};
  std::vector<std::vector<std::byte>> images = t.images();
  images.push_back(memref.content());
  ASSERT_GE(images.size(), 6u) << "marking, write-back and the store each flush";
  for (size_t i = 0; i < images.size(); ++i) {
    const std::string path = img.path() + ".crash";
    write_file(path, images[i]);
    auto check = testing::qemu_img_check(path);
    EXPECT_TRUE(check.status == 0 || check.status == 3) << "image " << i << ":\n" << check.output;
    if (i + 1 == images.size()) {
      EXPECT_EQ(check.status, 0) << "the closed image has no leaks:\n" << check.output;
    }
    ::unlink(path.c_str());
    for (const TrackedBitmap& b : bitmaps_of(images[i])) {
      if (b.entry.in_use()) continue;
      ASSERT_TRUE(b.bits) << "image " << i << ": " << b.entry.name;
      const auto ranges = b.bits->dirty_ranges();
      const auto& want = b.entry.name == "b0" ? want0 : want1;
      EXPECT_TRUE(ranges.empty() || ranges == want) << "image " << i << ": bitmap " << b.entry.name
                                                    << " is neither in use, empty nor complete";
    }
  }
  // The final image: both bitmaps stored, consistent, with every granule written.
  auto final_bitmaps = bitmaps_of(images.back());
  ASSERT_EQ(final_bitmaps.size(), 2u);
  for (const TrackedBitmap& b : final_bitmaps) {
    EXPECT_FALSE(b.entry.in_use()) << b.entry.name;
    ASSERT_TRUE(b.bits);
    EXPECT_EQ(b.bits->dirty_ranges(), b.entry.name == "b0" ? want0 : want1) << b.entry.name;
  }
}

}  // namespace
}  // namespace qcowfs::image::qcow2
