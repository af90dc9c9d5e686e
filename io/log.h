// The one logger: fmt-formatted lines with a level, to stderr (foreground),
// syslog (daemon) or a log file (-o log=FILE). Usage:
//   log::warn("cache=none refused by {}: falling back", path);
// Thread-safety: all functions are thread-safe; a line is written atomically.
#pragma once

#include <string_view>

#include <fmt/format.h>

namespace qcowfs::log {

enum class Level { debug = 0, info = 1, warn = 2, error = 3 };

void set_level(Level l);
Level level();
// After this, lines go to syslog with the given identity instead of stderr.
void use_syslog(const char* ident);
// After this, lines go to fd (opened O_APPEND: each line is one write), each
// with a UTC time stamp and the process id. The caller keeps fd open until
// it calls use_file(-1) (back to stderr, or syslog if chosen).
void use_file(int fd);
void write(Level l, std::string_view line);

template <typename... Args>
void debug(fmt::format_string<Args...> f, Args&&... args) {
  if (level() <= Level::debug) write(Level::debug, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
void info(fmt::format_string<Args...> f, Args&&... args) {
  if (level() <= Level::info) write(Level::info, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
void warn(fmt::format_string<Args...> f, Args&&... args) {
  if (level() <= Level::warn) write(Level::warn, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
void error(fmt::format_string<Args...> f, Args&&... args) {
  write(Level::error, fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace qcowfs::log
