// qcowfs: mounts a disk image (every format of image/formats.cc: qcow2, LUKS,
// VMDK, VHDX, VHD, VDI, QED, Parallels, raw; read-write with -o rw where the
// format's driver writes) as one raw file.
//   qcowfs [-f] [-d] [-o OPTIONS] IMAGE MOUNTPOINT     (see --help)
//   qcowfs create|info|check|map ...                   (tools/cmd.h)
//   qcowfs help [COMMAND]
// Without -f the command returns once the mount is up (exit 0) or has failed
// (exit 1, the reason on stderr); the daemon then logs to -o log=FILE, else
// to syslog.
// The one file of fuse/ that includes tools/: it only dispatches to them.
#include <fcntl.h>
#include <fuse_lowlevel.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "fuse/daemon.h"
#include "fuse/options.h"
#include "fuse/server.h"
#include "image/crypto/secret.h"
#include "io/fd.h"
#include "io/log.h"
#include "io/remote/remote_options.h"
#include "tools/cmd.h"

namespace {

using qcowfs::Result;
using qcowfs::Status;
namespace fuse = qcowfs::fuse;
namespace io = qcowfs::io;
namespace tools = qcowfs::tools;
namespace log = qcowfs::log;

constexpr const char* kSyslogSocket = "/dev/log";

Result<std::string> absolute_path(const std::string& path, const char* what) {
  char* resolved = ::realpath(path.c_str(), nullptr);
  if (!resolved) return Status::from_errno(errno, fmt::format("{} {}", what, path));
  std::string out(resolved);
  std::free(resolved);
  return out;
}

// Daemon mode moves to / once mounted; libfuse keeps the mount point to unmount it.
Status make_paths_absolute(fuse::Options& o) {
  auto image = io::is_remote_location(o.image) ? Result<std::string>(o.image) : absolute_path(o.image, "image");
  if (!image) return image.status();
  auto mountpoint = absolute_path(o.mountpoint, "mount point");
  if (!mountpoint) return mountpoint.status();
  o.image = *image;
  o.mountpoint = *mountpoint;
  if (!o.status_file.empty() && o.status_file[0] != '/') {
    auto dir = absolute_path(".", "directory");
    if (!dir) return dir.status();
    o.status_file = *dir + "/" + o.status_file;
  }
  return Status::ok();
}

// -o log=FILE, opened before daemonizing (relative to the caller's directory).
Result<io::UniqueFd> open_log_file(const std::string& path) {
  io::UniqueFd fd(::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NOCTTY, 0640));
  if (!fd.valid()) return Status::from_errno(errno, fmt::format("log file {}", path));
  return fd;
}

bool have_syslog() {
  struct stat st;
  return ::stat(kSyslogSocket, &st) == 0 && S_ISSOCK(st.st_mode);
}

int fail(const Status& st) {
  log::error("{}", st.to_string());
  return 1;
}

// Once mounted: where later messages go. The daemon's stderr is about to
// become /dev/null, so without a log file or a syslog socket it says so first.
// log_file stays open (owned by serve()) until the process exits.
void route_log(const fuse::Options& opts, const io::UniqueFd& log_file, bool daemon) {
  if (log_file.valid()) {
    log::use_file(log_file.get());
  } else if (daemon && have_syslog()) {
    log::use_syslog("qcowfs");
  } else if (daemon) {
    log::warn("no syslog socket ({}): messages after mounting (I/O errors, corruption) are lost; "
              "mount with -o log=FILE to keep them",
              kSyslogSocket);
  }
  log::debug("mounted {} on {}", opts.printable_image(), opts.mountpoint);
}

int serve(fuse::Options opts) {
  if (Status st = make_paths_absolute(opts); !st) return fail(st);
  io::UniqueFd log_file;
  if (!opts.log_file.empty()) {
    auto fd = open_log_file(opts.log_file);
    if (!fd) return fail(fd.status());
    log_file = std::move(*fd);
  }
  // An encrypted image asks for its passphrase on the terminal: opened now,
  // while the daemon still has one. Not for a directory of images, opened
  // later one by one: those take key-file= (SRCDIR/.qcowfs.conf).
  struct stat source {};
  const bool directory = ::stat(opts.image.c_str(), &source) == 0 && S_ISDIR(source.st_mode);
  if (!opts.image_options.keys && !directory)
    opts.image_options.keys = qcowfs::image::crypto::KeyProvider::from_terminal();
  fuse::DaemonReporter reporter;
  if (!opts.foreground) {
    auto r = fuse::daemonize();
    if (!r) return fail(r.status());
    reporter = std::move(*r);
  }
  // Returns once the kernel's FUSE INIT is answered and FUSE over io_uring is
  // set up (or refused): whatever can fail at start has.
  auto server = fuse::Server::start(opts);
  if (!server) {
    if (reporter.is_daemon()) {
      reporter.report_error(server.status().to_string());
      return 1;
    }
    return fail(server.status());
  }
  route_log(opts, log_file, reporter.is_daemon());
  (*server)->log_remotes();
  reporter.report_mounted();
  Status st = (*server)->run();
  server->reset();
  int code = st ? 0 : fail(st);
  log::use_file(-1);  // log_file closes now
  return code;
}

// qemu-img's commands that qcowfs does not have: a first argument naming one
// is a mistaken command, not an image (unless such a file exists).
constexpr std::array<std::string_view, 9> kForeignCommands = {
    "amend", "bench", "commit", "compare", "convert", "dd", "measure", "rebase", "snapshot",
};

bool is_bare_word(std::string_view s) {
  return !s.empty() && s[0] >= 'a' && s[0] <= 'z' && std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
  });
}

bool path_exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

// A first argument that is a command name qcowfs lacks, or a bare word that is
// no file when the arguments are not IMAGE MOUNTPOINT.
bool is_unknown_command(const std::vector<std::string>& args) {
  const std::string& first = args[0];
  if (!is_bare_word(first) || path_exists(first)) return false;
  if (std::find(kForeignCommands.begin(), kForeignCommands.end(), first) != kForeignCommands.end()) return true;
  size_t positional = 0;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "-o") ++i;
    else if (args[i].empty() || args[i][0] != '-') ++positional;
  }
  return positional != 2;
}

int unknown_command(std::string_view name) {
  std::fprintf(stderr,
               "qcowfs: unknown command '%.*s'\n"
               "Commands: %s (qcowfs COMMAND --help); to mount an image:\n"
               "  qcowfs [-f] [-o OPTION[,OPTION...]] IMAGE MOUNTPOINT\n"
               "Try 'qcowfs --help' for more information.\n",
               static_cast<int>(name.size()), name.data(), std::string(tools::subcommand_names()).c_str());
  return 1;
}

// `qcowfs help` shows --help; `qcowfs help COMMAND` shows COMMAND --help.
int help_command(const std::vector<std::string>& args) {
  if (args.size() >= 2 && tools::is_subcommand(args[1])) {
    const std::string help = "--help";
    return tools::run_subcommand(args[1], std::span<const std::string>(&help, 1));
  }
  if (args.size() >= 2) return unknown_command(args[1]);
  std::fputs(fuse::usage_text("qcowfs").c_str(), stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (!args.empty() && tools::is_subcommand(args[0]))
    return tools::run_subcommand(args[0], std::span<const std::string>(args).subspan(1));
  if (!args.empty() && args[0] == "help" && !path_exists(args[0])) return help_command(args);
  if (!args.empty() && is_unknown_command(args)) return unknown_command(args[0]);
  auto opts = fuse::parse_command_line(args);
  if (!opts) {
    std::fprintf(stderr, "qcowfs: %s\nTry 'qcowfs --help' for more information.\n", opts.status().to_string().c_str());
    return 1;
  }
  if (opts->help) {
    std::fputs(fuse::usage_text("qcowfs").c_str(), stdout);
    return 0;
  }
  if (opts->version) {
    std::printf("qcowfs %s (libfuse %s)\n", QCOWFS_VERSION, fuse_pkgversion());
    return 0;
  }
  if (opts->debug) log::set_level(log::Level::debug);
  return serve(std::move(*opts));
}
