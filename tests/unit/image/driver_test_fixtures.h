// Test fixtures shared by the unit tests of the formats that open through a
// free function open_<format>(file, path, opts) (QED, VDI, Parallels):
// - MemReadTest opens a synthetic image held in memory read-only and wraps
//   read, block status and the message of a refused open;
// - QemuImageWriteTest makes one image with qemu-img/qemu-io in /var/tmp in
//   SetUp (removed in TearDown), keeps its bytes, and opens in-memory copies.
// Each fixture owns a threads engine. Thread-safety: one test thread only.
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "image/block_driver.h"
#include "io/engine.h"
#include "io/mem_file.h"
#include "io/run_sync.h"
#include "unit/qcow2/qcow2_write_test_util.h"

namespace qcowfs::image::testing {

// open_qed, open_vdi, open_parallels.
using DriverOpener = Task<Result<std::unique_ptr<BlockDriver>>> (*)(std::unique_ptr<io::HostFile>, std::string,
                                                                     ImageOptions);

// Image is the test's synthetic image: its bytes are Image::b.
template <typename Image>
class MemReadTest : public ::testing::Test {
 protected:
  // path names the image in messages (the file itself is only in memory).
  MemReadTest(DriverOpener opener, std::string path)
      : engine_(std::move(*io::make_engine(io::EngineKind::threads))), opener_(opener), path_(std::move(path)) {}

  Result<std::unique_ptr<BlockDriver>> open(const Image& img, ImageOptions opts = {}) {
    io::MemFileOptions o;
    o.writable = false;
    o.path = path_;
    return io::run_sync(*engine_, opener_(std::make_unique<io::MemFile>(o, img.b), o.path, opts));
  }
  std::unique_ptr<BlockDriver> open_ok(const Image& img) {
    auto d = open(img);
    EXPECT_TRUE(d.is_ok()) << d.status().to_string();
    return d.is_ok() ? std::move(*d) : nullptr;
  }
  std::string refusal(const Image& img) {
    auto d = open(img);
    EXPECT_FALSE(d.is_ok());
    return d.is_ok() ? "" : d.status().message();
  }
  Status read(BlockDriver& d, uint64_t off, std::vector<std::byte>& buf) {
    return io::run_sync(*engine_, d.read(off, buf));
  }
  Result<BlockStatus> status(BlockDriver& d, uint64_t off, uint64_t len) {
    return io::run_sync(*engine_, d.block_status(off, len));
  }

  std::unique_ptr<io::Engine> engine_;

 private:
  DriverOpener opener_;
  std::string path_;
};

class QemuImageWriteTest : public ::testing::Test {
 protected:
  // make_cmd is the shell command that makes the image at path, a format
  // string with the path as {0} (its output is shown if it fails); path also
  // names the image to the driver.
  QemuImageWriteTest(DriverOpener opener, std::string path, std::string make_cmd)
      : opener_(opener), path_(std::move(path)), make_cmd_(std::move(make_cmd)) {}

  void SetUp() override {
    engine_ = std::move(*io::make_engine(io::EngineKind::threads));
    std::string out;
    ASSERT_EQ(qcow2::testing::shell(fmt::format(fmt::runtime(make_cmd_), path_), &out), 0) << out;
    good_ = qcow2::testing::read_file(path_);
  }
  void TearDown() override { ::unlink(path_.c_str()); }
  template <typename T>
  T run(Task<T> t) {
    return io::run_sync(*engine_, std::move(t));
  }
  // Opens a MemFile holding bytes, read-write if rw; *file is that MemFile.
  Result<std::unique_ptr<BlockDriver>> open(io::MemFile** file, const std::vector<std::byte>& bytes, bool rw = true) {
    auto mem = std::make_unique<io::MemFile>(io::MemFileOptions{}, bytes);
    *file = mem.get();
    ImageOptions o;
    o.file.writable = rw;
    return run(opener_(std::move(mem), path_, o));
  }

  std::unique_ptr<io::Engine> engine_;
  DriverOpener opener_;
  std::string path_;
  std::string make_cmd_;
  std::vector<std::byte> good_;
};

}  // namespace qcowfs::image::testing
