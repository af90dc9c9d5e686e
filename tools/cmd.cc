#include "tools/cmd.h"

#include <cmath>
#include <cstdio>

#include <fmt/format.h>

#include "image/block_driver.h"

namespace qcowfs::tools {

std::string_view subcommand_names() { return "create, info, check, map, resize, snapshot, bitmap"; }

bool is_subcommand(std::string_view name) {
  return name == "create" || name == "info" || name == "check" || name == "map" || name == "resize" ||
         name == "snapshot" || name == "bitmap";
}

int run_subcommand(std::string_view name, std::span<const std::string> args) {
  if (name == "create") return cmd_create(args);
  if (name == "info") return cmd_info(args);
  if (name == "check") return cmd_check(args);
  if (name == "resize") return cmd_resize(args);
  if (name == "snapshot") return cmd_snapshot(args);
  if (name == "bitmap") return cmd_bitmap(args);
  return cmd_map(args);
}

int cmd_fail(std::string_view cmd, const Status& st, int code) {
  fmt::print(stderr, "qcowfs {}: {}\n", cmd, st.to_string());
  return code;
}

int usage_error(std::string_view cmd, std::string_view message) {
  fmt::print(stderr, "qcowfs {}: {}\nTry 'qcowfs {} --help' for more information.\n", cmd, message, cmd);
  return 1;
}

void print_usage(std::string_view usage) { fmt::print("{}", usage); }

Result<std::unique_ptr<io::Engine>> tool_engine() { return io::make_engine(io::EngineKind::automatic, 64); }

Task<Result<ImageFile>> open_image_file(std::string path, io::OpenOptions options, std::string named,
                                        std::string backing_of) {
  auto f = io::open_host_file(path, options);
  if (!f) co_return f.status();
  auto format = co_await image::choose_format(**f, path, named, backing_of);
  if (!format) co_return format.status();
  co_return ImageFile{std::move(*f), std::move(*format)};
}

std::string human_size(uint64_t bytes) {
  // qemu's size_to_str(): the unit changes at 1000 of the smaller one, and the
  // number is printed with three significant digits ("196 KiB", "1.27 MiB").
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int exp = 0;
  std::frexp(static_cast<double>(bytes) / (1000.0 / 1024.0), &exp);
  int unit = (exp - 1) / 10;
  if (unit < 0) unit = 0;
  double div = std::ldexp(1.0, unit * 10);
  return fmt::format("{:.3g} {}", static_cast<double>(bytes) / div, kUnits[unit]);
}

bool take_option(std::span<const std::string> args, size_t& i, std::string_view long_name,
                 std::string_view short_name, std::string& value) {
  std::string_view a = args[i];
  bool has_next = i + 1 < args.size();
  if (!long_name.empty() && a.starts_with(long_name)) {
    std::string_view rest = a.substr(long_name.size());
    if (rest.starts_with("=")) {
      value = std::string(rest.substr(1));
      return true;
    }
    if (rest.empty() && has_next) {
      value = args[++i];
      return true;
    }
  }
  if (!short_name.empty() && a.starts_with(short_name)) {
    if (a.size() > short_name.size()) {
      value = std::string(a.substr(short_name.size()));
      return true;
    }
    if (has_next) {
      value = args[++i];
      return true;
    }
  }
  return false;
}

Status parse_common_image_arg(std::span<const std::string> args, size_t& i, ImageCommandArgs& a) {
  std::string v;
  if (args[i] == "-h" || args[i] == "--help") {
    a.help = true;
  } else if (args[i] == "-U" || args[i] == "--force-share") {
    a.force_share = true;
  } else if (args[i] == "--json") {
    a.json = true;
  } else if (take_option(args, i, "--output", "", v)) {
    if (v != "json" && v != "human") return Status::errorf(EINVAL, "bad output format '{}' (json or human)", v);
    a.json = v == "json";
  } else if (take_option(args, i, "--format", "-f", v)) {
    a.format = v;
  } else if (take_option(args, i, "--key-file", "", v)) {
    a.key_file = v;
  } else if (args[i].size() > 1 && args[i][0] == '-') {
    return Status::errorf(EINVAL, "unknown option '{}'", args[i]);
  } else if (a.image.empty()) {
    a.image = args[i];
  } else {
    return Status::errorf(EINVAL, "unexpected argument '{}'", args[i]);
  }
  return Status::ok();
}

std::shared_ptr<image::crypto::KeyProvider> key_provider(const std::string& key_file) {
  if (!key_file.empty()) return image::crypto::KeyProvider::from_file(key_file);
  return image::crypto::KeyProvider::from_terminal("--key-file PATH (or --key-file - for standard input)");
}

}  // namespace qcowfs::tools
