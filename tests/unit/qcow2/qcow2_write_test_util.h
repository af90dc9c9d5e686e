// Helpers for the qcow2 write-path unit tests: qemu-img-made images in
// /var/tmp (removed in the destructor), `qemu-img check` as the referee, a
// recording HostFile decorator that logs the order of writes and flushes, and
// a driver for running one coroutine on a private engine.
#pragma once

#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "unit/image/forwarding_file.h"
#include "io/engine.h"
#include "io/host_file.h"
#include "io/run_sync.h"
#include "unit/io/io_test_util.h"

namespace qcowfs::image::qcow2::testing {

inline int shell(const std::string& cmd, std::string* out = nullptr) {
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return -1;
  std::string text;
  char buf[512];
  while (size_t n = std::fread(buf, 1, sizeof buf, p)) text.append(buf, n);
  int rc = ::pclose(p);
  if (out) *out = text;
  return rc;
}

// The bytes of a host file, and a host file replaced by bytes (images saved
// for qemu-img and loaded into a MemFile).
using io::testing::read_file;
inline void write_file(const std::string& path, const std::vector<std::byte>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// A qcow2 image made by qemu-img: `qemu-img create -f qcow2 -o <options> PATH <size>`.
class TempImage {
 public:
  TempImage(const std::string& tag, const std::string& options, const std::string& size) {
    static int counter = 0;
    path_ = fmt::format("/var/tmp/qcowfs_w_{}_{}_{}.qcow2", tag, ::getpid(), counter++);
    std::string out;
    int rc = shell(
        fmt::format("qemu-img create -q -f qcow2 {} {} {}", options.empty() ? "" : "-o " + options, path_, size), &out);
    if (rc != 0) error_ = out;
  }
  ~TempImage() { ::unlink(path_.c_str()); }
  TempImage(const TempImage&) = delete;
  TempImage& operator=(const TempImage&) = delete;
  const std::string& path() const { return path_; }
  const std::string& error() const { return error_; }

 private:
  std::string path_;
  std::string error_;
};

// `qemu-img check` result: exit status 0 = clean, 1 = corruption, 2 = other error, 3 = leaks only.
struct CheckResult {
  int status = -1;
  std::string output;
};
inline CheckResult qemu_img_check(const std::string& path) {
  CheckResult r;
  int rc = shell("qemu-img check -U -f qcow2 " + path, &r.output);
  r.status = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  return r;
}

// Forwards to another HostFile and records each write, discard and flush.
class RecordingFile final : public qcowfs::testing::ForwardingFile {
 public:
  enum class Op { write, flush, discard };
  struct Event {
    Op op;
    uint64_t offset = 0;
    uint64_t length = 0;
  };
  explicit RecordingFile(std::unique_ptr<io::HostFile> inner) : ForwardingFile(std::move(inner)) {}

  std::vector<Event> events() const {
    std::lock_guard lk(mu_);
    return events_;
  }
  void clear() {
    std::lock_guard lk(mu_);
    events_.clear();
  }

  Task<Status> write(uint64_t off, std::span<const std::byte> buf) override {
    Status st = co_await inner().write(off, buf);
    if (st) record(Op::write, off, buf.size());
    co_return st;
  }
  Task<Status> writev(uint64_t off, std::span<const iovec> iov) override {
    uint64_t n = 0;
    for (const iovec& v : iov) n += v.iov_len;
    Status st = co_await inner().writev(off, iov);
    if (st) record(Op::write, off, n);
    co_return st;
  }
  Task<Status> flush() override {
    Status st = co_await inner().flush();
    if (st) record(Op::flush, 0, 0);
    co_return st;
  }
  Task<Status> discard(uint64_t off, uint64_t len) override {
    Status st = co_await inner().discard(off, len);
    if (st) record(Op::discard, off, len);
    co_return st;
  }
  Task<Status> write_zeroes(uint64_t off, uint64_t len) override {
    Status st = co_await inner().write_zeroes(off, len);
    if (st) record(Op::write, off, len);
    co_return st;
  }

 private:
  void record(Op op, uint64_t off, uint64_t len) {
    std::lock_guard lk(mu_);
    events_.push_back(Event{op, off, len});
  }
  mutable std::mutex mu_;
  std::vector<Event> events_;
};

inline std::unique_ptr<io::HostFile> open_rw(const std::string& path) {
  io::OpenOptions o;
  o.writable = true;
  auto f = io::open_host_file(path, o);
  if (!f) return nullptr;
  return std::move(*f);
}

}  // namespace qcowfs::image::qcow2::testing
