#include "io/log.h"

#include <syslog.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <mutex>
#include <string>

namespace qcowfs::log {
namespace {
std::atomic<Level> g_level{Level::info};
std::atomic<bool> g_syslog{false};
std::atomic<int> g_file{-1};
std::mutex g_mu;

const char* prefix(Level l) {
  switch (l) {
    case Level::debug: return "debug";
    case Level::info: return "info";
    case Level::warn: return "warning";
    case Level::error: return "error";
  }
  return "";
}

int syslog_priority(Level l) {
  switch (l) {
    case Level::debug: return LOG_DEBUG;
    case Level::info: return LOG_INFO;
    case Level::warn: return LOG_WARNING;
    case Level::error: return LOG_ERR;
  }
  return LOG_INFO;
}
// "2025-01-31T12:00:00.123Z qcowfs[4242]: error: ...", as a log file line.
std::string file_line(Level l, std::string_view line) {
  timespec now = {};
  ::clock_gettime(CLOCK_REALTIME, &now);
  tm utc = {};
  ::gmtime_r(&now.tv_sec, &utc);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%S", &utc);
  return fmt::format("{}.{:03}Z qcowfs[{}]: {}: {}\n", stamp, now.tv_nsec / 1000000, ::getpid(), prefix(l), line);
}
}  // namespace

void set_level(Level l) { g_level = l; }
Level level() { return g_level; }

void use_syslog(const char* ident) {
  openlog(ident, LOG_PID, LOG_DAEMON);
  g_syslog = true;
}

void use_file(int fd) { g_file = fd; }

void write(Level l, std::string_view line) {
  if (int fd = g_file; fd >= 0) {
    std::string out = file_line(l, line);
    ssize_t ignored = ::write(fd, out.data(), out.size());
    (void)ignored;
    return;
  }
  if (g_syslog) {
    syslog(syslog_priority(l), "%.*s", static_cast<int>(line.size()), line.data());
    return;
  }
  std::string out = fmt::format("qcowfs: {}: {}\n", prefix(l), line);
  std::lock_guard lk(g_mu);
  ssize_t ignored = ::write(STDERR_FILENO, out.data(), out.size());
  (void)ignored;
}

}  // namespace qcowfs::log
