// QemuDirTest: a test with a directory of its own in /var/tmp (made in SetUp,
// removed in TearDown) where images are made with qemu-img and qemu-io
// (sh()), and an engine (automatic: io_uring where the kernel allows) to open
// them on. Thread-safety: one test thread.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>

#include "io/engine.h"

namespace qcowfs::image::testing {

class QemuDirTest : public ::testing::Test {
 protected:
  // prefix: the directory's name before the test process's pid.
  explicit QemuDirTest(std::string prefix) : prefix_(std::move(prefix)) {}

  void SetUp() override {
    dir_ = std::filesystem::path("/var/tmp") / (prefix_ + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
    auto e = io::make_engine(io::EngineKind::automatic);
    ASSERT_TRUE(e.is_ok()) << e.status().to_string();
    engine_ = std::move(*e);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  // Runs a shell command in the test directory; fails the test on error.
  void sh(const std::string& cmd) {
    std::string full = "cd '" + dir_.string() + "' && { " + cmd + "; } >/dev/null";
    ASSERT_EQ(std::system(full.c_str()), 0) << full;
  }

  std::filesystem::path dir_;
  std::unique_ptr<io::Engine> engine_;

 private:
  std::string prefix_;
};

}  // namespace qcowfs::image::testing
