// Test fixtures shared by the unit tests of the formats that open through a
// free function open_<format>(file, path, opts) (QED, VDI): MemReadTest opens
// a synthetic image held in memory read-only and wraps read, block status and
// the message of a refused open. It owns a threads engine. Thread-safety: one
// test thread only.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "image/block_driver.h"
#include "io/engine.h"
#include "io/mem_file.h"
#include "io/run_sync.h"

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

}  // namespace qcowfs::image::testing
