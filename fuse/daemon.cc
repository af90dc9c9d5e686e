#include "fuse/daemon.h"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "io/log.h"

namespace qcowfs::fuse {
namespace {

constexpr char kMountedTag = '0';
constexpr char kErrorTag = '1';

void write_all(int fd, const std::string& s) {
  size_t done = 0;
  while (done < s.size()) {
    ssize_t n = ::write(fd, s.data() + done, s.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // the parent is gone: nobody left to tell
    done += static_cast<size_t>(n);
  }
}

std::string read_all(int fd) {
  std::string out;
  char buf[512];
  while (true) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return out;
    out.append(buf, static_cast<size_t>(n));
  }
}

// The parent's side: wait for the report, then exit with it.
[[noreturn]] void parent_wait(io::UniqueFd from_child, pid_t child) {
  std::string report = read_all(from_child.get());
  if (!report.empty() && report[0] == kMountedTag) std::exit(0);
  if (!report.empty() && report[0] == kErrorTag) {
    std::fprintf(stderr, "qcowfs: %s\n", report.c_str() + 1);
    std::exit(1);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  std::fprintf(stderr, "qcowfs: the daemon exited before mounting (status %d)\n", status);
  std::exit(1);
}

void redirect_stdio_to_null() {
  int null = ::open("/dev/null", O_RDWR | O_CLOEXEC);
  if (null < 0) return;
  for (int fd : {STDIN_FILENO, STDOUT_FILENO, STDERR_FILENO}) ::dup2(null, fd);
  if (null > STDERR_FILENO) ::close(null);
}

}  // namespace

void DaemonReporter::report_mounted() {
  if (!pipe_.valid()) return;
  // Paths were made absolute before forking; leaving the old cwd keeps it unmountable.
  if (::chdir("/") != 0) log::warn("cannot change directory to /: {}", std::strerror(errno));
  redirect_stdio_to_null();
  write_all(pipe_.get(), std::string(1, kMountedTag));
  pipe_.reset();
}

void DaemonReporter::report_error(const std::string& message) {
  if (!pipe_.valid()) return;
  write_all(pipe_.get(), std::string(1, kErrorTag) + message);
  pipe_.reset();
}

Result<DaemonReporter> daemonize() {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return Status::from_errno(errno, "pipe2");
  io::UniqueFd read_end(fds[0]), write_end(fds[1]);
  std::fflush(nullptr);
  pid_t pid = ::fork();
  if (pid < 0) return Status::from_errno(errno, "fork");
  if (pid > 0) {
    write_end.reset();
    parent_wait(std::move(read_end), pid);
  }
  read_end.reset();
  ::setsid();
  return DaemonReporter(std::move(write_end));
}

}  // namespace qcowfs::fuse
