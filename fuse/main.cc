// qcowfs: mounts a qcow2 or raw disk image as one raw file.
//   qcowfs [-f] [-d] [-o OPTIONS] IMAGE MOUNTPOINT     (see --help)
//   qcowfs create|info|check|map ...                   (tools/cmd.h)
// The one file of fuse/ that includes tools/: it only dispatches to them.
#include <fuse_lowlevel.h>
#include <stdlib.h>

#include <cstdio>
#include <string>
#include <vector>

#include "fuse/daemon.h"
#include "fuse/options.h"
#include "fuse/server.h"
#include "image/crypto/crypto_secret.h"
#include "io/log.h"
#include "tools/cmd.h"

namespace {

using qcowfs::Result;
using qcowfs::Status;
namespace fuse = qcowfs::fuse;
namespace tools = qcowfs::tools;
namespace log = qcowfs::log;

Result<std::string> absolute_path(const std::string& path, const char* what) {
  char* resolved = ::realpath(path.c_str(), nullptr);
  if (!resolved) return Status::from_errno(errno, fmt::format("{} {}", what, path));
  std::string out(resolved);
  std::free(resolved);
  return out;
}

// Daemon mode moves to / once mounted; libfuse keeps the mount point to unmount it.
Status make_paths_absolute(fuse::Options& o) {
  auto image = absolute_path(o.image, "image");
  if (!image) return image.status();
  auto mountpoint = absolute_path(o.mountpoint, "mount point");
  if (!mountpoint) return mountpoint.status();
  o.image = *image;
  o.mountpoint = *mountpoint;
  return Status::ok();
}

int fail(const Status& st) {
  log::error("{}", st.to_string());
  return 1;
}

int serve(fuse::Options opts) {
  if (Status st = make_paths_absolute(opts); !st) return fail(st);
  // An encrypted image asks for its passphrase on the terminal: opened now,
  // while the daemon still has one.
  if (!opts.image_options.keys) opts.image_options.keys = qcowfs::image::crypto::KeyProvider::from_terminal();
  fuse::DaemonReporter reporter;
  if (!opts.foreground) {
    auto r = fuse::daemonize();
    if (!r) return fail(r.status());
    reporter = std::move(*r);
  }
  auto server = fuse::Server::start(opts);
  if (!server) {
    if (reporter.is_daemon()) {
      reporter.report_error(server.status().to_string());
      return 1;
    }
    return fail(server.status());
  }
  if (reporter.is_daemon()) {
    log::use_syslog("qcowfs");
    reporter.report_mounted();
  }
  Status st = (*server)->run();
  server->reset();
  if (!st) return fail(st);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (!args.empty() && tools::is_subcommand(args[0]))
    return tools::run_subcommand(args[0], std::span<const std::string>(args).subspan(1));
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
