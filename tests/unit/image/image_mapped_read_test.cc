// Mapped reads (BlockDriver::map_read, image::MappedRead): a run releases its
// holds in the order they were added (the innermost driver's first) and only
// once; raw images and partition windows map 1:1 with their offsets; and
// every table format, read as a mount reads it (a run where the driver gives
// one, else read()), gives qemu-img convert's bytes, read-only and writable,
// with its plain data clusters read as runs.
#include <gtest/gtest.h>
#include <string>
#include <vector>

#include "image/block_driver.h"
#include "image/raw/raw.h"
#include "image/views/window.h"
#include "io/engine.h"
#include "io/mem_file.h"
#include "io/run_sync.h"
#include "unit/image/mapped_read_util.h"
#include "unit/image/qemu_dir_test.h"
#include "unit/io/io_test_util.h"

namespace qcowfs::image {
namespace {

using Bytes = std::vector<std::byte>;

io::Hold logging_hold(std::string* log, char c) {
  return io::Hold([](void* l, uint64_t ch) { static_cast<std::string*>(l)->push_back(static_cast<char>(ch)); }, log,
                  static_cast<uint64_t>(c));
}

TEST(MappedRead, HoldsAreReleasedInTheOrderAddedAndOnce) {
  std::string log;
  {
    MappedRead run(nullptr, 0);
    run.keep(logging_hold(&log, 'a'));
    run.keep(logging_hold(&log, 'b'));
    EXPECT_FALSE(run.full());
    run.keep(logging_hold(&log, 'c'));
    EXPECT_TRUE(run.full());
    MappedRead moved(std::move(run));  // the holds move with it
    EXPECT_EQ(log, "");
  }
  EXPECT_EQ(log, "abc");
}

TEST(MappedRead, AnIoHoldReleasesOnceAndMovesItsRelease) {
  std::string log;
  io::Hold h = logging_hold(&log, 'x');
  io::Hold other = std::move(h);
  EXPECT_FALSE(h.holds());  // NOLINT(bugprone-use-after-move): moved-from is empty by contract
  other.release();
  other.release();
  EXPECT_EQ(log, "x");
}

TEST(MappedRead, RawImagesAndWindowsMapOneToOne) {
  io::MemFile file(io::MemFileOptions{}, Bytes(1 << 20));
  RawDriver whole(&file, false);
  auto run = whole.map_read(4096, 8192);
  ASSERT_TRUE(run.has_value());
  EXPECT_EQ(run->file, &file);
  EXPECT_EQ(run->host_offset, 4096u);
  RawDriver part(&file, false, 65536, 131072);
  run = part.map_read(512, 512);
  ASSERT_TRUE(run.has_value());
  EXPECT_EQ(run->host_offset, 65536u + 512);
  WindowDriver window(&whole, 131072, 65536);
  run = window.map_read(4096, 4096);
  ASSERT_TRUE(run.has_value());
  EXPECT_EQ(run->host_offset, 131072u + 4096);
  EXPECT_FALSE(window.map_read(61440, 8192).has_value());  // past the window's end: read() refuses it
}

class MappedFormats : public testing::QemuDirTest {
 protected:
  MappedFormats() : QemuDirTest("qcowfs_mapped_read_test_") {}

  // Data, a partial cluster, zeros and a hole; then every byte as mounted,
  // twice (the first pass loads the tables), against qemu-img convert.
  void check(const std::string& fmt, const std::string& create_opts, bool writable) {
    const std::string name = "img." + fmt;
    sh("rm -f " + name + " ref.raw");
    sh("qemu-img create -q -f " + fmt + " " + create_opts + " " + name + " 8M");
    sh("qemu-io -f " + fmt + " -c 'write -P 0x11 0 2m' -c 'write -P 0x22 3000k 5k' -c 'write -P 0x33 6m 1m' " + name);
    sh("qemu-img convert -f " + fmt + " -O raw " + name + " ref.raw");
    const Bytes ref = io::testing::read_file(path("ref.raw"));
    ImageOptions opts;
    opts.format = fmt;
    opts.file.writable = writable;
    auto d = io::run_sync(*engine_, open_image(path(name), opts));
    ASSERT_TRUE(d.is_ok()) << fmt << ": " << d.status().to_string();
    for (size_t chunk : {size_t{65536}, size_t{4096}, size_t{12345}}) {
      size_t mapped = 0;
      auto got = io::run_sync(*engine_, testing::read_all_as_mounted(**d, chunk, &mapped));
      ASSERT_TRUE(got.is_ok()) << fmt << ": " << got.status().to_string();
      ASSERT_EQ(got->size(), ref.size()) << fmt;
      EXPECT_TRUE(*got == ref) << fmt << " (" << create_opts << ") differs from qemu-img convert with " << chunk
                               << "-byte reads as mounted";
      EXPECT_GT(mapped, 0u) << fmt << " (" << create_opts << "): no data read as a host run";
    }
    if (writable) {
      ASSERT_TRUE(io::run_sync(*engine_, (*d)->close()));
    }
  }
};

TEST_F(MappedFormats, EveryTableFormatReadsAsQemuThroughRuns) {
  const std::vector<std::pair<std::string, std::string>> formats = {
      {"qcow2", ""},
      {"qed", ""},
      {"vdi", ""},
      {"vdi", "-o static=on"},
      {"vhdx", ""},
      {"vpc", ""},
      {"vpc", "-o subformat=fixed"},
      {"vmdk", ""},
      {"vmdk", "-o subformat=monolithicFlat"},
      {"vmdk", "-o subformat=twoGbMaxExtentSparse"},
      {"parallels", ""},
      {"raw", ""},
  };
  for (const auto& [fmt, opts] : formats) {
    for (bool writable : {false, true}) {
      SCOPED_TRACE(fmt + " " + opts + (writable ? " writable" : " read-only"));
      check(fmt, opts, writable);
    }
  }
}

}  // namespace
}  // namespace qcowfs::image
