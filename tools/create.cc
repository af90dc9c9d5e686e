// qcowfs create: makes a new qcow2 (or raw) image, with qemu-img create's
// command line: -o takes qemu-img's option names, -b/-F name the backing file.
// Like qemu-img 7.2 it refuses a backing file without its format (-F or
// backing_fmt): the format is written into the image, and a probed one lets a
// raw backing file that starts like a qcow2 header pass itself off as one.
#include <cstdio>

#include "image/block_driver.h"
#include "image/path.h"
#include "image/qcow2/qcow2_create.h"
#include "image/raw/raw.h"
#include "tools/cmd.h"

namespace qcowfs::tools {
namespace {

namespace q = image::qcow2;

struct CreateArgs {
  std::string image;
  std::string format = "qcow2";
  std::string option_list;  // -o lists, joined with commas
  std::string backing, backing_format;
  std::string size;
  bool quiet = false;
  bool unsafe = false;  // -u: do not open the backing file
  bool help = false;
  q::CreateOptions create_options;  // the above as qcow2 create options (not with help)
};

Result<CreateArgs> parse_create_flags(std::span<const std::string> args) {
  CreateArgs a;
  std::vector<std::string> positional;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string v;
    if (args[i] == "-h" || args[i] == "--help") {
      a.help = true;
    } else if (args[i] == "-q" || args[i] == "--quiet") {
      a.quiet = true;
    } else if (args[i] == "-u") {
      a.unsafe = true;
    } else if (take_option(args, i, "--options", "-o", v)) {
      a.option_list += (a.option_list.empty() ? "" : ",") + v;
    } else if (take_option(args, i, "--backing", "-b", v)) {
      a.backing = v;
    } else if (take_option(args, i, "--backing-format", "-F", v)) {
      a.backing_format = v;
    } else if (take_option(args, i, "--format", "-f", v)) {
      if (v != "qcow2" && v != "raw") return Status::errorf(EINVAL, "unknown format '{}' (qcow2 or raw)", v);
      a.format = v;
    } else if (args[i].size() > 1 && args[i][0] == '-') {
      return Status::errorf(EINVAL, "unknown option '{}'", args[i]);
    } else {
      positional.push_back(args[i]);
    }
  }
  if (a.help) return a;
  if (positional.empty()) return Status::error(EINVAL, "missing IMAGE");
  if (positional.size() > 2) return Status::errorf(EINVAL, "unexpected argument '{}'", positional[2]);
  a.image = positional[0];
  if (positional.size() == 2) a.size = positional[1];
  return a;
}

Result<q::CreateOptions> build_options(const CreateArgs& a) {
  q::CreateOptions o;
  QCOWFS_TRY(q::apply_create_options(o, a.option_list));
  if (!a.size.empty()) QCOWFS_TRY(q::apply_create_option(o, "size", a.size));
  if (!a.backing.empty()) o.backing_file = a.backing;
  if (!a.backing_format.empty()) o.backing_format = a.backing_format;
  return o;
}

// The command line, its -o/-b/-F/SIZE turned into create options; errors are
// usage errors. With --help nothing but the flags is looked at.
Result<CreateArgs> parse_create_args(std::span<const std::string> args) {
  auto a = parse_create_flags(args);
  if (!a || a->help) return a;
  auto o = build_options(*a);
  if (!o) return o.status();
  a->create_options = std::move(*o);
  return a;
}

// qemu-img's refusal of a backing file without a format; `detected` is the
// probed format when the backing file was opened.
Status missing_backing_format(const std::string& image, std::string_view detected) {
  std::string msg = fmt::format("{}: Backing file specified without backing format", image);
  if (!detected.empty()) msg += fmt::format("\nDetected format of {}.", detected);
  return Status::error(EINVAL, std::move(msg));
}

// Opens the backing file (as qemu-img does, unless -u): it must open with the
// format given, and its size is the default image size.
Task<Status> inspect_backing(const CreateArgs& a, q::CreateOptions& o) {
  if (o.backing_file.empty()) co_return Status::ok();
  if (a.unsafe) {
    if (o.backing_format.empty()) co_return missing_backing_format(a.image, "");
    if (!o.size_given) co_return Status::errorf(EINVAL, "{}: Image creation needs a size parameter", a.image);
    co_return Status::ok();
  }
  image::ImageOptions bo;
  bo.format = o.backing_format;
  auto b = co_await image::open_image(image::resolve_relative(a.image, o.backing_file), bo);
  if (!b) co_return b.status().with_context(fmt::format("could not open backing file '{}'", o.backing_file));
  std::string detected((*b)->format_name());
  uint64_t size = (*b)->size();
  QCOWFS_CO_TRY(co_await (*b)->close());
  if (o.backing_format.empty()) co_return missing_backing_format(a.image, detected);
  if (!o.size_given) {
    o.size = size;
    o.size_given = true;
  }
  co_return Status::ok();
}

void print_formatting(const CreateArgs& a, const q::CreateOptions& o) {
  if (a.format == "raw") {
    fmt::print("Formatting '{}', fmt=raw size={}\n", a.image, o.size);
    return;
  }
  fmt::print("Formatting '{}', fmt=qcow2 cluster_size={} extended_l2={} compression_type={} size={}", a.image,
             o.cluster_size, o.extended_l2 ? "on" : "off", o.compression_type ? "zstd" : "zlib", o.size);
  if (!o.backing_file.empty()) fmt::print(" backing_file={}", o.backing_file);
  if (!o.backing_format.empty()) fmt::print(" backing_fmt={}", o.backing_format);
  if (!o.data_file.empty()) fmt::print(" data_file={} data_file_raw={}", o.data_file, o.data_file_raw ? "on" : "off");
  fmt::print(" lazy_refcounts={} refcount_bits={}", o.lazy_refcounts ? "on" : "off", o.refcount_bits);
  if (o.preallocation != q::Preallocation::off) fmt::print(" preallocation={}", q::to_string(o.preallocation));
  fmt::print("\n");
}

Task<Status> create_raw_file(const std::string& path, const q::CreateOptions& o) {
  auto f = io::create_host_file(path, io::OpenOptions{});
  if (!f) co_return f.status();
  bool allocate = o.preallocation == q::Preallocation::falloc || o.preallocation == q::Preallocation::full;
  co_return co_await image::create_raw(**f, o.size, allocate);
}

Task<Status> create_qcow2(const CreateArgs& a, q::CreateOptions o) {
  const std::string& path = a.image;
  QCOWFS_CO_TRY(co_await inspect_backing(a, o));
  auto valid = q::validate_create_options(std::move(o));
  if (!valid) co_return valid.status();
  if (!a.quiet) print_formatting(a, *valid);
  std::unique_ptr<io::HostFile> data;
  if (!valid->data_file.empty()) {
    auto d = io::create_host_file(image::resolve_relative(path, valid->data_file), io::OpenOptions{});
    if (!d) co_return d.status();
    data = std::move(*d);
  }
  auto f = io::create_host_file(path, io::OpenOptions{});
  if (!f) co_return f.status();
  co_return co_await q::write_new_image(**f, data.get(), *valid);
}

}  // namespace

std::string_view create_usage() {
  return "usage: qcowfs create [-f FORMAT] [-o OPTIONS] [-b BACKING -F BACKING_FMT [-u]] [-q] IMAGE [SIZE]\n"
         "\n"
         "Creates a qcow2 v3 image (or a raw one with -f raw). SIZE takes K, M, G, T\n"
         "suffixes; with a backing file it defaults to the backing file's size. A\n"
         "backing file needs its format (-F), as with qemu-img 7.2.\n"
         "\n"
         "  -f, --format=FMT          qcow2 (default) or raw\n"
         "  -o, --options=OPTS        comma-separated qemu-img options (below)\n"
         "  -b, --backing=FILE        backing file (relative names: to IMAGE's directory)\n"
         "  -F, --backing-format=FMT  backing file format (required with -b)\n"
         "  -u                        do not open the backing file (SIZE is then required)\n"
         "  -q, --quiet               do not print the 'Formatting' line\n"
         "  -h, --help                show this text\n"
         "\n"
         "options (-o):\n"
         "  size=SIZE                 virtual disk size\n"
         "  cluster_size=SIZE         512 to 2M, a power of two (default 64K)\n"
         "  compat=0.10|1.1           qcow2 version 2 or 3 (default 1.1)\n"
         "  refcount_bits=N           1, 2, 4, 8, 16 (default), 32 or 64\n"
         "  lazy_refcounts=on|off     lazy refcounts (compat=1.1)\n"
         "  extended_l2=on|off        subclusters (compat=1.1, clusters of 16K or more)\n"
         "  compression_type=zlib|zstd\n"
         "  preallocation=off|metadata|falloc|full\n"
         "  data_file=FILE            keep guest data in an external data file\n"
         "  data_file_raw=on|off      the data file is a raw image of the disk\n"
         "  backing_file=FILE         same as -b\n"
         "  backing_fmt=FMT           same as -F\n";
}

int cmd_create(std::span<const std::string> args) {
  return run_tool("create", create_usage(), parse_create_args(args), [](const CreateArgs& a, io::Engine& engine) {
    const q::CreateOptions& o = a.create_options;
    if (a.format == "raw" && !o.backing_file.empty())
      return cmd_fail("create", Status::errorf(EINVAL, "{}: Backing file not supported for file format 'raw'", a.image));
    if (a.format == "raw" && !o.size_given) return usage_error("create", "a raw image needs a SIZE");
    if (a.format == "raw" && !a.quiet) print_formatting(a, o);
    Status st = a.format == "raw" ? io::run_sync(engine, create_raw_file(a.image, o))
                                  : io::run_sync(engine, create_qcow2(a, o));
    if (!st) return cmd_fail("create", st);
    return 0;
  });
}

}  // namespace qcowfs::tools
