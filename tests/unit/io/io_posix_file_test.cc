// PosixFile tests on real files in /var/tmp (ext4) and on a loop device with
// 4096-byte sectors, over both engines: alignment detection, the O_DIRECT
// bounce paths at every misalignment (checked against pread through a
// page-cache fd), concurrent overlapping unaligned writes, EOF handling,
// discard, write_zeroes, truncate, holes and error reporting.
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <future>
#include <thread>

#include <gtest/gtest.h>

#include "io/align.h"
#include "io/buffer.h"
#include "io/engine.h"
#include "io/fd.h"
#include "io/posix_file.h"
#include "io/run_sync.h"
#include "unit/io/io_test_util.h"

namespace qcowfs::io {
namespace {

using testing::LoopDevice;
using testing::pattern;
using testing::TempFile;

constexpr size_t kFileSize = 256 * 1024;

std::unique_ptr<Engine> engine_of(EngineKind kind) {
  auto e = make_engine(kind);
  EXPECT_TRUE(e.is_ok()) << e.status().to_string();
  return e ? std::move(*e) : nullptr;
}

std::unique_ptr<HostFile> open_file(const std::string& path, CacheMode cache, bool writable = true) {
  OpenOptions o;
  o.writable = writable;
  o.cache = cache;
  auto f = open_host_file(path, o);
  EXPECT_TRUE(f.is_ok()) << f.status().to_string();
  return f ? std::move(*f) : nullptr;
}

// Reads the whole host content through the page cache, bypassing PosixFile.
std::vector<std::byte> host_content(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  struct stat st;
  ::fstat(fd.get(), &st);
  uint64_t size = static_cast<uint64_t>(st.st_size);
  if (S_ISBLK(st.st_mode)) {
    off_t end = ::lseek(fd.get(), 0, SEEK_END);
    size = static_cast<uint64_t>(end);
  }
  std::vector<std::byte> out(size);
  size_t done = 0;
  while (done < out.size()) {
    ssize_t r = ::pread(fd.get(), out.data() + done, out.size() - done, static_cast<off_t>(done));
    if (r <= 0) break;
    done += static_cast<size_t>(r);
  }
  out.resize(done);
  return out;
}

uint64_t host_size(const std::string& path) {
  struct stat st;
  ::stat(path.c_str(), &st);
  return static_cast<uint64_t>(st.st_size);
}

// ---- opening and alignment ----

TEST(PosixFileOpen, MissingFileNamesPath) {
  OpenOptions o;
  auto f = open_host_file("/var/tmp/qcowfs_io_does_not_exist", o);
  ASSERT_FALSE(f.is_ok());
  EXPECT_EQ(f.status().code(), ENOENT);
  EXPECT_NE(f.status().message().find("/var/tmp/qcowfs_io_does_not_exist"), std::string::npos);
}

TEST(PosixFileOpen, DirectoryIsRefused) {
  auto f = open_host_file("/var/tmp", OpenOptions{});
  ASSERT_FALSE(f.is_ok());
  EXPECT_EQ(f.status().code(), EINVAL);
  EXPECT_NE(f.status().message().find("a directory"), std::string::npos) << f.status().message();
}

TEST(PosixFileOpen, CharacterDeviceIsRefused) {
  auto f = open_host_file("/dev/null", OpenOptions{});
  ASSERT_FALSE(f.is_ok());
  EXPECT_EQ(f.status().code(), EINVAL);
  EXPECT_NE(f.status().message().find("character device"), std::string::npos) << f.status().message();
}

// A path under /var/tmp, removed at the end of the test, for a FIFO, a socket
// or a directory made there.
class TempPath {
 public:
  explicit TempPath(const std::string& tag) : path_(fmt::format("/var/tmp/qcowfs_io_{}_{}", tag, ::getpid())) {
    ::unlink(path_.c_str());
    ::rmdir(path_.c_str());
  }
  ~TempPath() {
    ::unlink(path_.c_str());
    ::rmdir(path_.c_str());
  }
  TempPath(const TempPath&) = delete;
  TempPath& operator=(const TempPath&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Opens path on another thread; a FIFO without a writer blocks a plain open(2)
// for ever, so after 5 s the test opens the write end to release it and fails.
Status open_within_seconds(const std::string& path, const OpenOptions& o) {
  auto done = std::async(std::launch::async, [&] { return open_host_file(path, o).status(); });
  if (done.wait_for(std::chrono::seconds(5)) == std::future_status::ready) return done.get();
  UniqueFd release(::open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC));
  done.wait();
  ADD_FAILURE() << "opening " << path << " blocked";
  return Status::error(ETIMEDOUT, "blocked");
}

void expect_refused(const Status& st, const std::string& path, const char* kind) {
  ASSERT_FALSE(st.is_ok()) << path << " was accepted";
  EXPECT_EQ(st.code(), EINVAL) << st.to_string();
  EXPECT_NE(st.message().find(fmt::format("{} is {}, not a regular file or block device", path, kind)),
            std::string::npos)
      << st.message();
}

TEST(PosixFileOpen, FifoIsRefusedWithoutBlockingInEveryMode) {
  TempPath fifo("fifo");
  ASSERT_EQ(::mkfifo(fifo.path().c_str(), 0600), 0);
  for (bool writable : {false, true}) {
    for (CacheMode cache : {CacheMode::writeback, CacheMode::none, CacheMode::writethrough}) {
      OpenOptions o;
      o.writable = writable;
      o.cache = cache;
      expect_refused(open_within_seconds(fifo.path(), o), fifo.path(), "a FIFO");
    }
  }
}

TEST(PosixFileOpen, SocketAndWritableDirectoryAreRefusedByType) {
  TempPath sock("sock");
  UniqueFd s(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", sock.path().c_str());
  ASSERT_EQ(::bind(s.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr), 0);
  OpenOptions rw;
  rw.writable = true;
  expect_refused(open_host_file(sock.path(), rw).status(), sock.path(), "a socket");
  TempPath dir("dir");
  ASSERT_EQ(::mkdir(dir.path().c_str(), 0700), 0);
  expect_refused(open_host_file(dir.path(), rw).status(), dir.path(), "a directory");  // not EISDIR
}

TEST(PosixFileOpen, OpenRegularOrBlockNamesWhatTheFileIs) {
  TempPath fifo("fifo_what");
  ASSERT_EQ(::mkfifo(fifo.path().c_str(), 0600), 0);
  auto f = open_regular_or_block(fifo.path(), O_RDONLY, "the key file");
  ASSERT_FALSE(f.is_ok());
  EXPECT_NE(f.status().message().find("the key file " + fifo.path() + " is a FIFO"), std::string::npos)
      << f.status().message();
  auto missing = open_regular_or_block(fifo.path() + "_missing", O_RDONLY, "the key file");
  ASSERT_FALSE(missing.is_ok());
  EXPECT_EQ(missing.status().code(), ENOENT);
}

TEST(PosixFileOpen, CreateRefusesADirectoryAndLeavesAFifoAlone) {
  TempPath dir("create_dir");
  ASSERT_EQ(::mkdir(dir.path().c_str(), 0700), 0);
  expect_refused(create_host_file(dir.path(), OpenOptions{}).status(), dir.path(), "a directory");  // not EISDIR
  TempPath fifo("create_fifo");
  ASSERT_EQ(::mkfifo(fifo.path().c_str(), 0600), 0);
  expect_refused(create_host_file(fifo.path(), OpenOptions{}).status(), fifo.path(), "a FIFO");
  struct stat st;
  ASSERT_EQ(::stat(fifo.path().c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
}

// The throwaway overlay's file: no name in its directory at any time, usable
// as any writable file, flushes that do nothing (cache=unsafe).
TEST(PosixFileOpen, UnnamedFileHasNoNameAndWorks) {
  TempPath dir("unnamed_dir");
  ASSERT_EQ(::mkdir(dir.path().c_str(), 0700), 0);
  auto engine = engine_of(EngineKind::threads);
  ASSERT_TRUE(engine);
  {
    auto f = create_unnamed_file(dir.path());
    ASSERT_TRUE(f.is_ok()) << f.status().to_string();
    EXPECT_TRUE((*f)->writable());
    EXPECT_EQ((*f)->cache_mode(), CacheMode::unsafe);
    EXPECT_EQ((*f)->size(), 0u);
    const auto data = pattern(8192, 3);
    ASSERT_TRUE(run_sync(*engine, (*f)->write(4096, data)));
    ASSERT_TRUE(run_sync(*engine, (*f)->flush()));
    EXPECT_EQ((*f)->size(), 4096u + 8192u);
    std::vector<std::byte> back(8192);
    auto n = run_sync(*engine, (*f)->read(4096, back));
    ASSERT_TRUE(n.is_ok());
    EXPECT_EQ(*n, back.size());
    EXPECT_EQ(back, data);
    EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
  }
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
  auto missing = create_unnamed_file(dir.path() + "/missing");
  ASSERT_FALSE(missing.is_ok());
  EXPECT_EQ(missing.status().code(), ENOENT);
  EXPECT_NE(missing.status().message().find(dir.path() + "/missing"), std::string::npos) << missing.status().message();
}

TEST(PosixFileOpen, RegularFileIsLeftBlocking) {
  TempFile t("nonblock", 4096);
  auto fd = open_regular_or_block(t.path(), O_RDWR);
  ASSERT_TRUE(fd.is_ok()) << fd.status().to_string();
  const int fl = ::fcntl(fd->get(), F_GETFL);
  EXPECT_EQ(fl & O_NONBLOCK, 0);
  EXPECT_EQ(fl & O_ACCMODE, O_RDWR);
  EXPECT_NE(::fcntl(fd->get(), F_GETFD) & FD_CLOEXEC, 0);
}

TEST(PosixFileOpen, PageCacheModesNeedNoAlignment) {
  TempFile tf("open", 12345);
  for (CacheMode m : {CacheMode::writeback, CacheMode::writethrough, CacheMode::unsafe}) {
    auto f = open_file(tf.path(), m);
    ASSERT_TRUE(f);
    EXPECT_EQ(f->offset_align(), 1u);
    EXPECT_GE(f->mem_align(), 4096u);
    EXPECT_EQ(f->size(), 12345u);
    EXPECT_EQ(f->cache_mode(), m);
    EXPECT_FALSE(f->is_block_device());
  }
}

TEST(PosixFileOpen, DirectAlignmentMatchesStatx) {
  TempFile tf("align", kFileSize);
  auto f = open_file(tf.path(), CacheMode::none);
  ASSERT_TRUE(f);
  EXPECT_EQ(f->cache_mode(), CacheMode::none);
  struct statx sx {};
  ASSERT_EQ(::statx(AT_FDCWD, tf.path().c_str(), 0, STATX_DIOALIGN, &sx), 0);
  if (sx.stx_mask & STATX_DIOALIGN) {
    EXPECT_EQ(f->offset_align(), sx.stx_dio_offset_align);
  } else {
    EXPECT_TRUE(is_pow2(f->offset_align()));
  }
  EXPECT_GE(f->offset_align(), 512u);
  EXPECT_GE(f->mem_align(), 4096u);
}

// What an O_DIRECT reader of the file would need is known in every cache mode
// (FUSE passthrough readers bring their own flags): statx's answer, the same
// as what cache=none detects, and 4096 on a 4096-byte-sector device.
TEST(PosixFileOpen, DirectIoAlignIsKnownInEveryCacheMode) {
  TempFile tf("dioalign", kFileSize);
  struct statx sx {};
  ASSERT_EQ(::statx(AT_FDCWD, tf.path().c_str(), 0, STATX_DIOALIGN, &sx), 0);
  ASSERT_TRUE(sx.stx_mask & STATX_DIOALIGN) << "this kernel does not report STATX_DIOALIGN for /var/tmp";
  const size_t want = std::max<size_t>(sx.stx_dio_offset_align, sx.stx_dio_mem_align);
  for (CacheMode m : {CacheMode::none, CacheMode::writeback, CacheMode::writethrough, CacheMode::unsafe}) {
    auto f = open_file(tf.path(), m);
    ASSERT_TRUE(f);
    EXPECT_EQ(f->direct_io_align(), want) << to_string(m);
  }
  TempFile backing("dioalign4k", 4 << 20);
  LoopDevice loop(backing.path(), 4096);
  ASSERT_TRUE(loop.ok()) << loop.error();
  auto dev = open_file(loop.device(), CacheMode::none);
  ASSERT_TRUE(dev);
  EXPECT_EQ(dev->direct_io_align(), 4096u);
}

TEST(PosixFileOpen, ProbeFindsAlignmentWithoutStatx) {
  TempFile tf("probe", kFileSize);
  UniqueFd fd(::open(tf.path().c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC));
  ASSERT_TRUE(fd.valid());
  DirectAlignment a = probe_direct_alignment(fd.get(), kFileSize);
  EXPECT_TRUE(is_pow2(a.offset));
  // Whatever was detected must really work for an O_DIRECT read, and half of it must not
  // (unless it is already the smallest sector size).
  AlignedBuffer buf(8192, 4096);
  EXPECT_EQ(::pread(fd.get(), buf.data(), a.offset, static_cast<off_t>(a.offset)), static_cast<ssize_t>(a.offset));
  if (a.offset > 512) {
    EXPECT_LT(::pread(fd.get(), buf.data(), a.offset / 2, 0), 0);
  }
  // Too small a file cannot be probed (reads at EOF always succeed): assume the worst.
  TempFile empty("probe_empty");
  UniqueFd efd(::open(empty.path().c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC));
  ASSERT_TRUE(efd.valid());
  EXPECT_EQ(probe_direct_alignment(efd.get(), 0).offset, 4096u);
  // statx, where the kernel reports it, must agree with the probe on a file this size.
  auto detected = detect_direct_alignment(fd.get(), false, kFileSize);
  ASSERT_TRUE(detected.has_value());
  EXPECT_EQ(detected->offset, a.offset);
}

TEST(PosixFileOpen, CacheModeNamesRoundTrip) {
  for (CacheMode m : {CacheMode::none, CacheMode::writethrough, CacheMode::writeback, CacheMode::unsafe}) {
    auto parsed = parse_cache_mode(to_string(m));
    ASSERT_TRUE(parsed.is_ok());
    EXPECT_EQ(*parsed, m);
  }
  auto bad = parse_cache_mode("directsync");
  ASSERT_FALSE(bad.is_ok());
  EXPECT_EQ(bad.status().code(), EINVAL);
}

TEST(PosixFileOpen, NoEngineIsAClearError) {
  TempFile tf("noengine", 4096);
  auto f = open_file(tf.path(), CacheMode::writeback);
  ASSERT_TRUE(f);
  ASSERT_EQ(Engine::current(), nullptr);
  std::vector<std::byte> buf(10);
  std::optional<Result<size_t>> got;
  spawn_then(f->read(0, buf), [&](Result<size_t> r) { got.emplace(std::move(r)); });
  ASSERT_TRUE(got.has_value());  // completes at once, without suspending
  ASSERT_FALSE(got->is_ok());
  EXPECT_EQ(got->status().code(), EINVAL);
  EXPECT_NE(got->status().message().find("no engine on this thread"), std::string::npos);
}

// ---- I/O over both engines ----

class PosixFileIo : public ::testing::TestWithParam<EngineKind> {
 protected:
  void SetUp() override { engine_ = engine_of(GetParam()); }
  template <typename T>
  T run(Task<T> t) {
    return run_sync(*engine_, std::move(t));
  }
  std::unique_ptr<Engine> engine_;
};

TEST_P(PosixFileIo, ReadOnlyFileRefusesWrites) {
  TempFile tf("ro", 4096);
  auto f = open_file(tf.path(), CacheMode::writeback, false);
  ASSERT_TRUE(f);
  std::vector<std::byte> buf(10);
  Status st = run(f->write(0, buf));
  EXPECT_EQ(st.code(), EROFS);
  EXPECT_EQ(run(f->truncate(0)).code(), EROFS);
  EXPECT_EQ(run(f->discard(0, 4096)).code(), EROFS);
}

TEST_P(PosixFileIo, ReadStopsAtEof) {
  TempFile tf("eof");
  for (CacheMode m : {CacheMode::writeback, CacheMode::none}) {
    auto f = open_file(tf.path(), m);
    ASSERT_TRUE(f);
    auto data = pattern(10000, 7);
    ASSERT_TRUE(run(f->write(0, data)).is_ok());
    EXPECT_EQ(f->size(), 10000u);
    EXPECT_EQ(host_size(tf.path()), 10000u) << "cache " << to_string(m);
    std::vector<std::byte> buf(8192, std::byte{0xEE});
    auto n = run(f->read(5000, buf));
    ASSERT_TRUE(n.is_ok()) << n.status().to_string();
    EXPECT_EQ(*n, 5000u);
    EXPECT_TRUE(std::equal(buf.begin(), buf.begin() + 5000, data.begin() + 5000));
    EXPECT_EQ(buf[5000], std::byte{0xEE}) << "bytes past EOF must be left untouched";
    auto past = run(f->read(20000, buf));
    ASSERT_TRUE(past.is_ok());
    EXPECT_EQ(*past, 0u);
    ASSERT_TRUE(run(f->truncate(0)).is_ok());
  }
}

TEST_P(PosixFileIo, UnalignedWritePastEofSetsExactSize) {
  TempFile tf("grow");
  auto f = open_file(tf.path(), CacheMode::none);
  ASSERT_TRUE(f);
  auto a = pattern(100, 1);
  ASSERT_TRUE(run(f->write(3, a)).is_ok());
  EXPECT_EQ(f->size(), 103u);
  EXPECT_EQ(host_size(tf.path()), 103u);
  auto b = pattern(10, 2);
  ASSERT_TRUE(run(f->write(70000, b)).is_ok());  // far past EOF: a hole in between
  EXPECT_EQ(f->size(), 70010u);
  EXPECT_EQ(host_size(tf.path()), 70010u);
  auto content = host_content(tf.path());
  ASSERT_EQ(content.size(), 70010u);
  EXPECT_EQ(content[0], std::byte{0});
  EXPECT_TRUE(std::equal(a.begin(), a.end(), content.begin() + 3));
  EXPECT_TRUE(std::all_of(content.begin() + 103, content.begin() + 70000, [](std::byte x) { return x == std::byte{0}; }));
  EXPECT_TRUE(std::equal(b.begin(), b.end(), content.begin() + 70000));
}

// Sweeps every offset and length residue modulo 4096 around 4096-byte boundaries,
// checking reads against the host (page cache) and writes against a shadow copy.
void sweep_misalignment(HostFile& f, const std::string& path, Engine& engine) {
  auto shadow = host_content(path);
  ASSERT_GE(shadow.size(), kFileSize);
  shadow.resize(f.size());
  auto check_read = [&](uint64_t off, size_t len) -> Task<bool> {
    std::vector<std::byte> buf(len);
    auto n = co_await f.read(off, buf);
    if (!n || *n != len) co_return false;
    co_return std::equal(buf.begin(), buf.end(), shadow.begin() + static_cast<std::ptrdiff_t>(off));
  };
  auto do_write = [&](uint64_t off, size_t len, uint32_t seed) -> Task<bool> {
    auto data = pattern(len, seed);
    Status st = co_await f.write(off, data);
    if (!st) co_return false;
    std::copy(data.begin(), data.end(), shadow.begin() + static_cast<std::ptrdiff_t>(off));
    co_return true;
  };
  // Every offset residue d (crossing the 8192 boundary) paired with a distinct
  // length residue ((d * 2473) mod 4096 runs through all of 0..4095, 2473 being
  // odd), lengths spanning zero to two further blocks; then every offset residue
  // again for short writes that stay inside one block.
  auto sweep = [&]() -> Task<int> {
    int failures = 0;
    for (uint64_t d = 0; d < 4096; ++d) {
      const uint64_t off = 8192 + d;
      const size_t len = 1 + (d * 2473) % 4096 + 4096 * (d % 3);
      if (!co_await check_read(off, len)) ++failures;
      if (!co_await do_write(off, len, static_cast<uint32_t>(d))) ++failures;
    }
    for (uint64_t d = 0; d < 4096; d += 3) {
      const uint64_t off = 65536 + d;
      const size_t len = std::min<size_t>(1 + d % 61, 4096 - d);
      if (!co_await do_write(off, len, static_cast<uint32_t>(d + 7000))) ++failures;
      if (!co_await check_read(off - d % 5, len + d % 5)) ++failures;
    }
    co_return failures;
  };
  EXPECT_EQ(run_sync(engine, sweep()), 0);
  auto host = host_content(path);
  host.resize(std::min(host.size(), shadow.size()));
  EXPECT_TRUE(host == shadow) << "host content differs from the shadow copy";
}

TEST_P(PosixFileIo, BounceBufferAtEveryMisalignmentOnExt4) {
  TempFile tf("sweep", kFileSize);
  {
    auto init = pattern(kFileSize, 99);
    UniqueFd fd(::open(tf.path().c_str(), O_WRONLY | O_CLOEXEC));
    ASSERT_EQ(::pwrite(fd.get(), init.data(), init.size(), 0), static_cast<ssize_t>(init.size()));
  }
  auto f = open_file(tf.path(), CacheMode::none);
  ASSERT_TRUE(f);
  ASSERT_GT(f->offset_align(), 1u);
  sweep_misalignment(*f, tf.path(), *engine_);
}

TEST_P(PosixFileIo, BounceBufferOn4096SectorLoopDevice) {
  TempFile backing("loop", kFileSize);
  {
    auto init = pattern(kFileSize, 42);
    UniqueFd fd(::open(backing.path().c_str(), O_WRONLY | O_CLOEXEC));
    ASSERT_EQ(::pwrite(fd.get(), init.data(), init.size(), 0), static_cast<ssize_t>(init.size()));
  }
  LoopDevice loop(backing.path(), 4096);
  if (!loop.ok()) GTEST_SKIP() << "no loop device: " << loop.error();
  auto f = open_file(loop.device(), CacheMode::none);
  ASSERT_TRUE(f);
  EXPECT_TRUE(f->is_block_device());
  EXPECT_EQ(f->offset_align(), 4096u);
  EXPECT_EQ(f->size(), kFileSize);
  EXPECT_EQ(f->allocated_bytes(), kFileSize);
  EXPECT_EQ(run(f->truncate(0)).code(), EINVAL);
  sweep_misalignment(*f, loop.device(), *engine_);
  // Devices zero whole sectors with BLKZEROOUT and the partial ones by writing.
  Status zst = run(f->write_zeroes(4000, 10000));
  ASSERT_TRUE(zst.is_ok()) << zst.to_string();
  auto host = host_content(loop.device());
  EXPECT_TRUE(std::all_of(host.begin() + 4000, host.begin() + 14000, [](std::byte x) { return x == std::byte{0}; }));
  EXPECT_NE(host[3999], std::byte{0});
  EXPECT_NE(host[14000], std::byte{0});
  ASSERT_TRUE(run(f->discard(0, 8192)).is_ok());
  std::vector<std::byte> big(kFileSize + 4096);
  auto n = run(f->read(0, big));
  ASSERT_TRUE(n.is_ok());
  EXPECT_EQ(*n, kFileSize);
}

TEST_P(PosixFileIo, ConcurrentUnalignedWritesSharingBlocksLoseNothing) {
  TempFile tf("race", kFileSize);
  auto f = open_file(tf.path(), CacheMode::none);
  ASSERT_TRUE(f);
  // Two loops on two threads; writes of 100 bytes at stride 100 share host
  // blocks, interleaved with aligned writes of whole blocks further on: any
  // unserialised read-modify-write would put back stale bytes.
  constexpr int kWrites = 600;
  auto other = engine_of(GetParam());
  auto worker = [&](Engine* e, int parity, std::atomic<int>* failures) {
    ScopedEngine scope(e);
    int done = 0;
    // Parameters, not captures: the coroutine outlives this loop iteration.
    auto one = [](HostFile* file, int i, std::atomic<int>* fails, int* finished) -> Task<void> {
      auto data = pattern(100, static_cast<uint32_t>(i));
      if (!(co_await file->write(static_cast<uint64_t>(i) * 100, data))) ++*fails;
      ++*finished;
    };
    for (int i = parity; i < kWrites; i += 2) spawn(one(f.get(), i, failures, &done));
    while (done < kWrites / 2) e->run_once(50);
  };
  std::atomic<int> failures{0};
  std::thread t(worker, other.get(), 1, &failures);
  worker(engine_.get(), 0, &failures);
  t.join();
  EXPECT_EQ(failures, 0);
  auto host = host_content(tf.path());
  for (int i = 0; i < kWrites; ++i) {
    auto want = pattern(100, static_cast<uint32_t>(i));
    ASSERT_TRUE(std::equal(want.begin(), want.end(), host.begin() + i * 100)) << "write " << i << " was lost";
  }
}

TEST_P(PosixFileIo, UnalignedWritesRacingAlignedWritesOfTheSameBlock) {
  TempFile tf("mixed", kFileSize);
  auto f = open_file(tf.path(), CacheMode::none);
  ASSERT_TRUE(f);
  const size_t a = f->offset_align();
  // Per block: an aligned write of the whole block, then an unaligned write of
  // its first 7 bytes, queued together. Serialised in either order, bytes
  // 7..a-1 must hold the aligned write's data.
  constexpr int kBlocks = 48;
  std::vector<AlignedBuffer> blocks;
  for (int b = 0; b < kBlocks; ++b) {
    blocks.emplace_back(a, f->mem_align());
    auto p = pattern(a, static_cast<uint32_t>(b + 100));
    std::memcpy(blocks.back().data(), p.data(), a);
  }
  int done = 0, failures = 0;
  ScopedEngine scope(engine_.get());
  const std::vector<std::byte> seven(7, std::byte{0x5A});
  auto write_one = [](HostFile* file, std::span<const std::byte> data, uint64_t off, int* fails,
                      int* finished) -> Task<void> {
    if (!(co_await file->write(off, data))) ++*fails;
    ++*finished;
  };
  for (int b = 0; b < kBlocks; ++b) {
    const uint64_t off = static_cast<uint64_t>(b) * a;
    auto whole = blocks[static_cast<size_t>(b)].span();
    if (b % 2) {
      spawn(write_one(f.get(), whole, off, &failures, &done));
      spawn(write_one(f.get(), seven, off, &failures, &done));
    } else {
      spawn(write_one(f.get(), seven, off, &failures, &done));
      spawn(write_one(f.get(), whole, off, &failures, &done));
    }
  }
  while (done < 2 * kBlocks) engine_->run_once(50);
  EXPECT_EQ(failures, 0);
  auto host = host_content(tf.path());
  for (int b = 0; b < kBlocks; ++b) {
    const std::byte* blk = host.data() + static_cast<size_t>(b) * a;
    EXPECT_TRUE(std::equal(blk + 7, blk + a, blocks[static_cast<size_t>(b)].data() + 7)) << "block " << b;
  }
}

TEST_P(PosixFileIo, VectoredIoWithMisalignedSegmentsAndManySegments) {
  TempFile tf("vec", 8 << 20);
  for (CacheMode m : {CacheMode::none, CacheMode::writeback}) {
    auto f = open_file(tf.path(), m);
    ASSERT_TRUE(f);
    // 1500 segments (more than IOV_MAX) of 4096 aligned bytes: goes straight through.
    constexpr size_t kSegs = 1500;
    AlignedBuffer src(kSegs * 4096, 4096), dst(kSegs * 4096, 4096);
    auto p = pattern(src.size(), static_cast<uint32_t>(m == CacheMode::none ? 3 : 4));
    std::memcpy(src.data(), p.data(), p.size());
    std::vector<iovec> wiov, riov;
    for (size_t i = 0; i < kSegs; ++i) {
      wiov.push_back(iovec{src.data() + i * 4096, 4096});
      riov.push_back(iovec{dst.data() + (kSegs - 1 - i) * 4096, 4096});  // reversed order
    }
    ASSERT_TRUE(run(f->writev(4096, wiov)).is_ok());
    auto n = run(f->readv(4096, riov));
    ASSERT_TRUE(n.is_ok());
    EXPECT_EQ(*n, kSegs * 4096);
    for (size_t i = 0; i < kSegs; ++i)
      ASSERT_EQ(std::memcmp(dst.data() + (kSegs - 1 - i) * 4096, src.data() + i * 4096, 4096), 0) << i;
    // Odd-sized segments at odd addresses and an odd offset: bounced on O_DIRECT.
    std::vector<std::byte> a1 = pattern(3, 5), a2 = pattern(5000, 6), a3 = pattern(77, 7);
    std::vector<iovec> odd{{a1.data(), a1.size()}, {a2.data() + 1, a2.size() - 1}, {a3.data(), a3.size()}};
    ASSERT_TRUE(run(f->writev(12345, odd)).is_ok());
    std::vector<std::byte> back(3 + 4999 + 77);
    std::vector<std::byte> r1(3), r2(4999), r3(77);
    std::vector<iovec> rodd{{r1.data(), 3}, {r2.data(), 4999}, {r3.data(), 77}};
    auto m2 = run(f->readv(12345, rodd));
    ASSERT_TRUE(m2.is_ok());
    EXPECT_EQ(*m2, back.size());
    EXPECT_EQ(r1, a1);
    EXPECT_TRUE(std::equal(r2.begin(), r2.end(), a2.begin() + 1));
    EXPECT_EQ(r3, a3);
  }
}

TEST_P(PosixFileIo, DiscardMakesHoleReadingZeros) {
  TempFile tf("discard");
  for (CacheMode m : {CacheMode::none, CacheMode::writeback}) {
    auto f = open_file(tf.path(), m);
    ASSERT_TRUE(f);
    auto data = pattern(1 << 20, 11);
    ASSERT_TRUE(run(f->write(0, data)).is_ok());
    ASSERT_TRUE(run(f->flush()).is_ok());
    uint64_t before = f->allocated_bytes();
    ASSERT_TRUE(run(f->discard(256 * 1024, 512 * 1024)).is_ok());
    EXPECT_LT(f->allocated_bytes(), before);
    EXPECT_EQ(f->size(), 1u << 20);
    std::vector<std::byte> buf(512 * 1024 + 2);
    auto n = run(f->read(256 * 1024 - 1, buf));
    ASSERT_TRUE(n.is_ok());
    EXPECT_EQ(buf.front(), data[256 * 1024 - 1]);
    EXPECT_TRUE(std::all_of(buf.begin() + 1, buf.end() - 1, [](std::byte x) { return x == std::byte{0}; }));
    EXPECT_EQ(buf.back(), data[768 * 1024]);
    // Holes are visible to seek_data/seek_hole.
    auto hole = run(f->seek_hole(0));
    ASSERT_TRUE(hole.is_ok());
    EXPECT_EQ(*hole, 256u * 1024);
    auto next = run(f->seek_data(256 * 1024));
    ASSERT_TRUE(next.is_ok());
    EXPECT_EQ(*next, 768u * 1024);
    auto end_hole = run(f->seek_hole(768 * 1024));
    ASSERT_TRUE(end_hole.is_ok());
    EXPECT_EQ(*end_hole, 1u << 20);
    auto past = run(f->seek_data(5u << 20));
    ASSERT_TRUE(past.is_ok());
    EXPECT_EQ(*past, 1u << 20);
    ASSERT_TRUE(run(f->truncate(0)).is_ok());
  }
}

TEST_P(PosixFileIo, WriteZeroesUnalignedAndPastEof) {
  TempFile tf("zeroes");
  auto f = open_file(tf.path(), CacheMode::none);
  ASSERT_TRUE(f);
  auto data = pattern(100000, 12);
  ASSERT_TRUE(run(f->write(0, data)).is_ok());
  ASSERT_TRUE(run(f->write_zeroes(1001, 50000)).is_ok());
  ASSERT_TRUE(run(f->write_zeroes(99000, 3001)).is_ok());  // extends to 102001
  EXPECT_EQ(f->size(), 102001u);
  EXPECT_EQ(host_size(tf.path()), 102001u);
  auto host = host_content(tf.path());
  EXPECT_TRUE(std::equal(data.begin(), data.begin() + 1001, host.begin()));
  EXPECT_TRUE(std::all_of(host.begin() + 1001, host.begin() + 51001, [](std::byte x) { return x == std::byte{0}; }));
  EXPECT_TRUE(std::equal(data.begin() + 51001, data.begin() + 99000, host.begin() + 51001));
  EXPECT_TRUE(std::all_of(host.begin() + 99000, host.end(), [](std::byte x) { return x == std::byte{0}; }));
}

TEST_P(PosixFileIo, TruncateShrinksAndGrows) {
  TempFile tf("trunc");
  auto f = open_file(tf.path(), CacheMode::none);
  ASSERT_TRUE(f);
  auto data = pattern(20000, 13);
  ASSERT_TRUE(run(f->write(0, data)).is_ok());
  ASSERT_TRUE(run(f->truncate(5000)).is_ok());
  EXPECT_EQ(f->size(), 5000u);
  EXPECT_EQ(host_size(tf.path()), 5000u);
  ASSERT_TRUE(run(f->truncate(9000)).is_ok());
  EXPECT_EQ(f->size(), 9000u);
  std::vector<std::byte> buf(9000);
  auto n = run(f->read(0, buf));
  ASSERT_TRUE(n.is_ok());
  EXPECT_EQ(*n, 9000u);
  EXPECT_TRUE(std::equal(data.begin(), data.begin() + 5000, buf.begin()));
  EXPECT_TRUE(std::all_of(buf.begin() + 5000, buf.end(), [](std::byte x) { return x == std::byte{0}; }));
}

TEST_P(PosixFileIo, FlushInEveryCacheMode) {
  TempFile tf("flush", 4096);
  for (CacheMode m : {CacheMode::none, CacheMode::writethrough, CacheMode::writeback, CacheMode::unsafe}) {
    auto f = open_file(tf.path(), m);
    ASSERT_TRUE(f);
    auto data = pattern(4096, static_cast<uint32_t>(m) + 20);
    ASSERT_TRUE(run(f->write(0, data)).is_ok());
    EXPECT_TRUE(run(f->flush()).is_ok()) << to_string(m);
    EXPECT_EQ(host_content(tf.path()), data);
  }
}

TEST_P(PosixFileIo, ReadErrorCarriesErrnoAndPath) {
  TempFile tf("err", 4096);
  // An offset beyond off_t's range is refused by the kernel with EINVAL; the
  // Status must carry that errno and name the file.
  auto f = open_file(tf.path(), CacheMode::writeback);
  ASSERT_TRUE(f);
  std::vector<std::byte> buf(16);
  auto huge = run(f->read(UINT64_MAX - 8, buf));
  EXPECT_FALSE(huge.is_ok());
  EXPECT_EQ(huge.status().code(), EINVAL);
  EXPECT_NE(huge.status().message().find(tf.path()), std::string::npos) << huge.status().message();
}

std::string engine_name(const ::testing::TestParamInfo<EngineKind>& p) {
  return p.param == EngineKind::io_uring ? "io_uring" : "threads";
}

INSTANTIATE_TEST_SUITE_P(Engines, PosixFileIo, ::testing::Values(EngineKind::io_uring, EngineKind::threads),
                         engine_name);

}  // namespace
}  // namespace qcowfs::io
