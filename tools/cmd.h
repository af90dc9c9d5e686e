// The qcowfs subcommands (git style: `qcowfs create|info|check|map|resize|snapshot ...`),
// each a function from its arguments (without the subcommand name) to a
// process exit code. They print to stdout/stderr and run their image I/O on a
// private Engine through io::run_sync. They use image/ and io/ only, never
// FUSE: fuse/main.cc merely dispatches here. Shared helpers live here too.
// Thread-safety: each runs on the main thread of a short-lived process.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "image/crypto/secret.h"
#include "image/json.h"
#include "io/engine.h"
#include "io/host_file.h"
#include "io/run_sync.h"
#include "io/status.h"

namespace qcowfs::tools {

using image::Json;
using image::json_quote;

// The subcommands, for messages: "create, info, check, map, resize, snapshot, bitmap".
std::string_view subcommand_names();
// True when `name` (argv[1]) is a subcommand.
bool is_subcommand(std::string_view name);
// Runs subcommand `name` with its arguments; returns the exit code.
int run_subcommand(std::string_view name, std::span<const std::string> args);

int cmd_create(std::span<const std::string> args);
int cmd_info(std::span<const std::string> args);
int cmd_check(std::span<const std::string> args);
int cmd_map(std::span<const std::string> args);
int cmd_resize(std::span<const std::string> args);
int cmd_snapshot(std::span<const std::string> args);
int cmd_bitmap(std::span<const std::string> args);

// Every subcommand's --help text (the man page documents the same options).
std::string_view create_usage();
std::string_view info_usage();
std::string_view check_usage();
std::string_view map_usage();
std::string_view resize_usage();
std::string_view snapshot_usage();
std::string_view bitmap_usage();

// ---- helpers shared by the subcommands ----

// Prints "qcowfs CMD: message" to stderr and returns exit code `code`.
int cmd_fail(std::string_view cmd, const Status& st, int code = 1);
// Prints a usage error and the --help hint; returns 1.
int usage_error(std::string_view cmd, std::string_view message);
// Prints a --help text to stdout.
void print_usage(std::string_view usage);

// A private engine for the process (io_uring, else threads).
Result<std::unique_ptr<io::Engine>> tool_engine();

// The opening every subcommand shares: a failed parse is a usage error (exit
// 1), --help (Args::help) prints `usage` (exit 0); otherwise the private
// engine is made (its failure reported as "qcowfs NAME: ...", exit 1) and the
// exit code is body(args, engine)'s.
template <typename Args, typename Body>
int run_tool(std::string_view name, std::string_view usage, Result<Args> parsed, Body body) {
  if (!parsed) return usage_error(name, parsed.status().message());
  if (parsed->help) {
    print_usage(usage);
    return 0;
  }
  auto engine = tool_engine();
  if (!engine) return cmd_fail(name, engine.status());
  return body(*parsed, **engine);
}

// An image's host file and its format (`named`, else probed), for the
// commands that read an image's structures themselves (info, check).
// backing_of names the overlay when path is its backing file.
struct ImageFile {
  std::unique_ptr<io::HostFile> file;
  std::string format;
};
Task<Result<ImageFile>> open_image_file(std::string path, io::OpenOptions options, std::string named,
                                        std::string backing_of);

// "1.5 GiB", "196 KiB", "512 B": qemu-img's human sizes.
std::string human_size(uint64_t bytes);

// Matches `--name=value`, `--name value` and `-x value` forms: returns true and
// sets value (advancing i) when args[i] is one of them.
bool take_option(std::span<const std::string> args, size_t& i, std::string_view long_name,
                 std::string_view short_name, std::string& value);

// Where an encrypted image's passphrase comes from for a command: the
// --key-file given, else the terminal (its ENOKEY message names --key-file).
std::shared_ptr<image::crypto::KeyProvider> key_provider(const std::string& key_file);

// What the image-inspecting commands (info, check, map) all take: -h/--help,
// --json or --output=json|human, -f/--format FMT, -U/--force-share and one IMAGE.
struct ImageCommandArgs {
  std::string image;
  std::string format;
  std::string key_file;  // --key-file: an encrypted image's passphrase (the file's content, "-": stdin)
  bool json = false;
  bool help = false;
  // -U, --force-share (qemu-img's names): open read-only with locks that share
  // everything, so an image a writer holds (a VM, a rw mount) can be read.
  bool force_share = false;
  // How the image files are opened read-only (force_share applied).
  io::OpenOptions read_options() const {
    io::OpenOptions o;
    o.force_share = force_share;
    return o;
  }
};
// Parses args into `common`. Each argument is first offered to
// `extra(args, i)` (command-specific flags), which returns true when it took
// args[i] (advancing i past a value), false to pass, or an error; then to
// parse_common_image_arg(). Unknown options and stray arguments are errors.
Status parse_common_image_arg(std::span<const std::string> args, size_t& i, ImageCommandArgs& a);

template <typename Extra>
Status parse_image_command(std::span<const std::string> args, ImageCommandArgs& common, Extra extra) {
  for (size_t i = 0; i < args.size(); ++i) {
    Result<bool> took = extra(args, i);
    if (!took) return took.status();
    if (!*took) QCOWFS_TRY(parse_common_image_arg(args, i, common));
  }
  if (!common.help && common.image.empty()) return Status::error(EINVAL, "missing IMAGE");
  return Status::ok();
}

}  // namespace qcowfs::tools
