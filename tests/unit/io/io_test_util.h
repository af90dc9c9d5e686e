// Helpers shared by the io unit tests: temporary files in /var/tmp (a real
// ext4 file system here, unlike /tmp on some hosts) and loop devices, both
// removed in their destructors.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "io/engine.h"
#include "io/task.h"

namespace qcowfs::io::testing {

// A test fixture with a threads engine made current for the test (coroutines
// spawned in the test run on it); settle() runs a few non-blocking iterations.
class ThreadsEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto e = make_engine(EngineKind::threads);
    ASSERT_TRUE(e.is_ok());
    engine_ = std::move(*e);
    scope_ = std::make_unique<ScopedEngine>(engine_.get());
  }
  void TearDown() override { scope_.reset(); }
  void settle() {
    for (int i = 0; i < 5; ++i) engine_->run_once(0);
  }

  std::unique_ptr<Engine> engine_;
  std::unique_ptr<ScopedEngine> scope_;
};

// The long crash-consistency tests (every flush and cut point of a random
// workload, each image checked by qemu-img) run 1/kSanitizerScale of their
// steps in the sanitizer build (tests/run-all.sh's build-asan, where the same
// work is several times slower): it needs the code paths, which the first
// steps already take; the main build runs every step.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr int kSanitizerScale = 3;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
inline constexpr int kSanitizerScale = 3;
#else
inline constexpr int kSanitizerScale = 1;
#endif
#else
inline constexpr int kSanitizerScale = 1;
#endif

// The bytes of a host file (empty when it cannot be read; at most max bytes),
// read in one piece: the tests load images of many megabytes, and a byte-wise
// stream iterator is slow in the sanitizer builds.
inline std::vector<std::byte> read_file(const std::string& path, size_t max = SIZE_MAX) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return {};
  const auto size = static_cast<size_t>(in.tellg());
  std::vector<std::byte> out(std::min(size, max));
  in.seekg(0);
  in.read(reinterpret_cast<char*>(out.data()), static_cast<std::streamsize>(out.size()));
  out.resize(static_cast<size_t>(in.gcount()));
  return out;
}

class TempFile {
 public:
  explicit TempFile(const std::string& tag, size_t size = 0) {
    static int counter = 0;
    path_ = fmt::format("/var/tmp/qcowfs_io_{}_{}_{}", tag, ::getpid(), counter++);
    int fd = ::open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd >= 0) {
      if (size && ::ftruncate(fd, static_cast<off_t>(size)) != 0) path_.clear();
      ::close(fd);
    }
  }
  ~TempFile() { ::unlink(path_.c_str()); }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Runs a shell command, returning its stdout (trailing newline removed) and exit status.
inline int run_command(const std::string& cmd, std::string* out) {
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return -1;
  char buf[512];
  out->clear();
  while (size_t n = std::fread(buf, 1, sizeof(buf), p)) out->append(buf, n);
  int rc = ::pclose(p);
  while (!out->empty() && out->back() == '\n') out->pop_back();
  return rc;
}

// A loop device over a backing file; detached in the destructor.
class LoopDevice {
 public:
  LoopDevice(const std::string& backing, unsigned sector_size) {
    std::string out;
    int rc = run_command(fmt::format("losetup --sector-size {} -f --show {}", sector_size, backing), &out);
    if (rc == 0 && out.rfind("/dev/", 0) == 0) device_ = out;
    else error_ = fmt::format("losetup failed (status {}): {}", rc, out);
  }
  ~LoopDevice() {
    if (device_.empty()) return;
    std::string out;
    run_command("losetup -d " + device_, &out);
  }
  LoopDevice(const LoopDevice&) = delete;
  LoopDevice& operator=(const LoopDevice&) = delete;
  bool ok() const { return !device_.empty(); }
  const std::string& device() const { return device_; }
  const std::string& error() const { return error_; }

 private:
  std::string device_;
  std::string error_;
};

// Deterministic non-zero test pattern.
inline std::vector<std::byte> pattern(size_t n, uint32_t seed) {
  std::vector<std::byte> v(n);
  uint32_t x = seed * 2654435761u + 1;
  for (auto& b : v) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    b = static_cast<std::byte>(x | 1);
  }
  return v;
}

// Runs t to completion without an engine; for I/O that never suspends
// (MemFile), so the task must be done at once.
template <typename T>
T run_now(Task<T> t) {
  std::optional<T> out;
  spawn_then(std::move(t), [&](T v) { out.emplace(std::move(v)); });
  EXPECT_TRUE(out.has_value()) << "task suspended: it was expected to complete synchronously";
  return std::move(*out);
}

}  // namespace qcowfs::io::testing
