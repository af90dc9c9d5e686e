// make_engine(automatic) on a host where io_uring is filtered (as seccomp does
// in many containers): it must fall back to threads with one warning saying
// why, and I/O must work. Runs in a death-test child so the seccomp filter
// stays out of the rest of the suite.
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/syscall.h>

#include <cstddef>
#include <cstdlib>

#include <gtest/gtest.h>

#include "io/engine.h"
#include "io/host_file.h"
#include "io/run_sync.h"
#include "unit/io/io_test_util.h"

namespace qcowfs::io {
namespace {

bool deny_io_uring_setup() {
  sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  sock_fprog prog{static_cast<unsigned short>(sizeof(filter) / sizeof(filter[0])), filter};
  return ::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0 &&
         ::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) == 0;
}

Task<bool> write_and_read_back(HostFile& f) {
  auto data = testing::pattern(10000, 5);
  if (!(co_await f.write(123, data))) co_return false;
  std::vector<std::byte> back(data.size());
  auto n = co_await f.read(123, back);
  co_return n && *n == data.size() && back == data;
}

// Returns 0, or a code saying which check failed.
int fallback(const std::string& path) {
  if (!deny_io_uring_setup()) return 2;
  auto explicit_uring = make_engine(EngineKind::io_uring);
  if (explicit_uring || explicit_uring.status().code() != EPERM) return 3;
  auto first = make_engine(EngineKind::automatic);
  auto second = make_engine(EngineKind::automatic);  // must not warn again
  if (!first || !second || (*first)->name() != "threads") return 4;
  OpenOptions o;
  o.writable = true;
  o.cache = CacheMode::none;
  auto f = open_host_file(path, o);
  if (!f) return 5;
  return run_sync(**first, write_and_read_back(**f)) ? 0 : 6;
}

// std::exit skips the destructors of locals: remove the temp file first.
[[noreturn]] void fallback_child() {
  int rc;
  {
    testing::TempFile tf("fallback");
    rc = fallback(tf.path());
  }
  std::exit(rc);
}

TEST(EngineFallback, FilteredIoUringFallsBackToThreadsWithOneWarning) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(fallback_child(), ::testing::ExitedWithCode(0),
              "^qcowfs: warning: io_uring unavailable \\([^)]*Operation not permitted\\): using threads\n$");
}

}  // namespace
}  // namespace qcowfs::io
