// PosixFile on hosts that refuse things, simulated with seccomp filters in
// death-test children: a file system refusing O_DIRECT (cache=none fails
// with a clear message; the default, writeback, opens), and one without FALLOC_FL_ZERO_RANGE / PUNCH_HOLE (write_zeroes
// falls back to writing zeros; discard, a hint, reports success).
#include <fcntl.h>
#include <linux/falloc.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdlib>

#include <gtest/gtest.h>

#include "io/engine.h"
#include "io/fd.h"
#include "io/posix_file.h"
#include "io/run_sync.h"
#include "unit/io/io_test_util.h"

namespace qcowfs::io {
namespace {

// Makes syscall nr fail with err whenever (argument arg & mask) != 0.
bool deny_when(int nr, unsigned arg, uint32_t mask, int err) {
  sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, static_cast<uint32_t>(nr), 0, 3),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, static_cast<uint32_t>(offsetof(seccomp_data, args) + arg * 8)),
      BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, mask, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (static_cast<uint32_t>(err) & SECCOMP_RET_DATA)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  sock_fprog prog{static_cast<unsigned short>(sizeof(filter) / sizeof(filter[0])), filter};
  return ::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0 && ::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) == 0;
}

std::unique_ptr<Engine> threads_engine() {
  auto e = make_engine(EngineKind::threads);  // its syscalls pass through the filter
  return e ? std::move(*e) : nullptr;
}

// Runs body(path of a fresh temp file) and exits with its code; the file is
// removed first (std::exit skips the destructors of locals).
template <typename Body>
[[noreturn]] void run_child(const char* tag, Body body) {
  int rc;
  {
    testing::TempFile tf(tag, 8192);
    rc = body(tf.path());
  }
  std::exit(rc);
}

int direct_refused(const std::string& path) {
  if (!deny_when(__NR_openat, 2, O_DIRECT, EINVAL)) return 2;
  OpenOptions o;
  o.writable = true;
  o.cache = CacheMode::none;
  auto strict = open_host_file(path, o);
  if (strict || strict.status().code() != EINVAL) return 3;
  if (strict.status().message().find("does not support O_DIRECT") == std::string::npos) return 4;
  o.cache.reset();  // the default, writeback, never asks for O_DIRECT
  auto relaxed = open_host_file(path, o);
  if (!relaxed || (*relaxed)->cache_mode() != CacheMode::writeback || (*relaxed)->offset_align() != 1) return 5;
  auto engine = threads_engine();
  auto data = testing::pattern(100, 1);
  if (!engine || !run_sync(*engine, (*relaxed)->write(3, data)).is_ok()) return 6;
  return 0;
}

TEST(PosixFileHost, ODirectRefusedFailsCacheNoneWhileTheDefaultOpens) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  // Nothing falls back, so nothing is logged.
  EXPECT_EXIT(run_child("nodirect", direct_refused), ::testing::ExitedWithCode(0), "^$");
}

Task<int> zero_and_discard(HostFile& f) {
  auto data = testing::pattern(4 << 20, 2);
  if (!(co_await f.write(0, data))) co_return 10;
  // 3 MiB from an odd offset, ending past EOF: several zero chunks, extends the file.
  if (!(co_await f.write_zeroes(1001, 3u << 20))) co_return 11;
  if (!(co_await f.write_zeroes((4u << 20) - 10, 30))) co_return 12;
  if (f.size() != (4u << 20) + 20) co_return 13;
  std::vector<std::byte> back(f.size());
  auto n = co_await f.read(0, back);
  if (!n || *n != back.size()) co_return 14;
  if (!std::equal(back.begin(), back.begin() + 1001, data.begin())) co_return 15;
  if (!std::all_of(back.begin() + 1001, back.begin() + 1001 + (3 << 20), [](std::byte b) { return b == std::byte{0}; }))
    co_return 16;
  if (!std::equal(back.begin() + 1001 + (3 << 20), back.end() - 30, data.begin() + 1001 + (3 << 20))) co_return 17;
  if (!std::all_of(back.end() - 30, back.end(), [](std::byte b) { return b == std::byte{0}; })) co_return 18;
  // Punching is refused: discard still reports success (it is a hint) and changes nothing.
  if (!(co_await f.discard(0, 4096))) co_return 19;
  auto m = co_await f.read(0, back);
  if (!m || !std::equal(back.begin(), back.begin() + 1001, data.begin())) co_return 20;
  co_return 0;
}

int no_fallocate(const std::string& path, CacheMode cache) {
  if (!deny_when(__NR_fallocate, 1, FALLOC_FL_ZERO_RANGE | FALLOC_FL_PUNCH_HOLE, EOPNOTSUPP)) return 2;
  OpenOptions o;
  o.writable = true;
  o.cache = cache;
  auto f = open_host_file(path, o);
  if (!f) return 3;
  {  // the filter really is in the way
    UniqueFd fd(::open(path.c_str(), O_RDWR | O_CLOEXEC));
    if (::fallocate(fd.get(), FALLOC_FL_ZERO_RANGE, 0, 4096) == 0 || errno != EOPNOTSUPP) return 4;
  }
  auto engine = threads_engine();
  if (!engine) return 5;
  return run_sync(*engine, zero_and_discard(**f));
}

TEST(PosixFileHost, WriteZeroesFallsBackToWritingZerosWithoutZeroRange) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  for (CacheMode cache : {CacheMode::writeback, CacheMode::none}) {
    EXPECT_EXIT(run_child("nozero", [cache](const std::string& p) { return no_fallocate(p, cache); }),
                ::testing::ExitedWithCode(0), "")
        << to_string(cache);
  }
}

}  // namespace
}  // namespace qcowfs::io
