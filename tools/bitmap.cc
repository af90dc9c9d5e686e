// qcowfs bitmap: adds, removes, clears, enables, disables and merges the
// persistent dirty bitmaps of an image through the format's BitmapOps
// (image/bitmap.h), with qemu-img 7.2 bitmap's command line, messages and exit
// codes (0, or 1 on any error). The image is opened read-write with QEMU's
// write lock, so an image a VM or a mount is using is refused; a merge source
// given with -b is opened read-only.
#include <algorithm>
#include <string>
#include <vector>

#include "image/create.h"
#include "image/crypto/secret.h"
#include "image/format.h"
#include "tools/cmd.h"

namespace qcowfs::tools {
namespace {

struct BitmapArgs {
  bool help = false;
  std::string image;
  std::string format;
  std::string source_file;
  std::string source_format;
  std::string key_file;
  uint64_t granularity = 0;
  bool granularity_given = false;
  image::BitmapRequest request;
};

Result<bool> take_action(const std::string& arg, std::span<const std::string> args, size_t& i, BitmapArgs& a) {
  using K = image::BitmapActionKind;
  for (auto [flag, kind] : {std::pair{"--add", K::add}, std::pair{"--remove", K::remove}, std::pair{"--clear", K::clear},
                            std::pair{"--enable", K::enable}, std::pair{"--disable", K::disable}}) {
    if (arg != flag) continue;
    a.request.actions.push_back(image::BitmapAction{kind, {}});
    return true;
  }
  std::string v;
  if (take_option(args, i, "--merge", "", v)) {
    a.request.actions.push_back(image::BitmapAction{K::merge, v});
    return true;
  }
  return false;
}

Result<bool> take_value_option(std::span<const std::string> args, size_t& i, BitmapArgs& a) {
  std::string v;
  if (take_option(args, i, "--format", "-f", v)) return a.format = v, true;
  if (take_option(args, i, "--source-file", "-b", v)) return a.source_file = v, true;
  if (take_option(args, i, "--source-format", "-F", v)) return a.source_format = v, true;
  if (take_option(args, i, "--key-file", "", v)) return a.key_file = v, true;
  if (take_option(args, i, "--granularity", "-g", v)) {
    auto n = image::parse_create_size("granularity", v);
    if (!n)
      return Status::error(EINVAL, "Invalid granularity specified! You may use k, M, G, T, P or E suffixes for "
                                   "kilobytes, megabytes, gigabytes, terabytes, petabytes and exabytes.");
    a.granularity = *n;
    a.granularity_given = true;
    return true;
  }
  return false;
}

// qemu-img img_bitmap()'s checks, in its order.
Status check_combination(const BitmapArgs& a, const std::vector<std::string>& positional) {
  using K = image::BitmapActionKind;
  const auto& acts = a.request.actions;
  auto has = [&](K k) { return std::any_of(acts.begin(), acts.end(), [&](const auto& x) { return x.kind == k; }); };
  if (acts.empty())
    return Status::error(EINVAL, "Need at least one of --add, --remove, --clear, --enable, --disable, or --merge");
  if (a.granularity_given && !has(K::add)) return Status::error(EINVAL, "granularity only supported with --add");
  if (!a.source_format.empty() && a.source_file.empty()) return Status::error(EINVAL, "-F only supported with -b");
  if (!a.source_file.empty() && !has(K::merge))
    return Status::error(EINVAL, "Merge bitmap source file only supported with --merge");
  if (positional.size() != 2) return Status::error(EINVAL, "Expecting filename and bitmap name");
  return Status::ok();
}

Result<BitmapArgs> parse_bitmap_args(std::span<const std::string> args) {
  BitmapArgs a;
  std::vector<std::string> positional;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "-h" || arg == "--help") {
      a.help = true;
      return a;
    }
    auto act = take_action(arg, args, i, a);
    if (!act) return act.status();
    if (*act) continue;
    auto opt = take_value_option(args, i, a);
    if (!opt) return opt.status();
    if (*opt) continue;
    if (arg.size() > 1 && arg[0] == '-') return Status::errorf(EINVAL, "unknown option '{}'", arg);
    positional.push_back(arg);
  }
  QCOWFS_TRY(check_combination(a, positional));
  a.image = positional[0];
  a.request.bitmap = positional[1];
  a.request.granularity = a.granularity;
  a.request.keys = key_provider(a.key_file);
  return a;
}

// The -b image's bitmaps, one per --merge in order.
Task<Status> read_merge_sources(BitmapArgs& a) {
  if (a.source_file.empty()) co_return Status::ok();
  io::OpenOptions o;
  for (const image::BitmapAction& act : a.request.actions) {
    if (act.kind != image::BitmapActionKind::merge) continue;
    auto src = co_await open_image_file(a.source_file, o, a.source_format, "");
    if (!src) co_return src.status();
    const image::FormatInfo* format = image::find_format(src->format);
    if (!format || !format->bitmap)
      co_return Status::errorf(ENOENT, "Operation merge on bitmap {} failed: Dirty bitmap '{}' not found",
                               a.request.bitmap, act.source);
    auto bits = co_await format->bitmap->read(std::move(src->file), a.source_file, act.source);
    if (!bits)
      co_return Status::errorf(bits.status().code(), "Operation merge on bitmap {} failed: {}", a.request.bitmap,
                               bits.status().message());
    a.request.merge_sources.push_back(std::move(*bits));
  }
  co_return Status::ok();
}

Task<Status> bitmap(BitmapArgs a) {
  io::OpenOptions o;
  o.writable = true;
  auto image = co_await open_image_file(a.image, o, a.format, "");
  if (!image) co_return image.status();
  const image::FormatInfo* format = image::find_format(image->format);
  const image::BitmapAction& first = a.request.actions.front();
  if (!format || !format->bitmap) {
    if (first.kind == image::BitmapActionKind::add)
      co_return Status::errorf(ENOTSUP, "Operation add on bitmap {} failed: Can't make bitmap '{}' persistent in "
                                        "'{}': Block format '{}' does not support persistent bitmaps",
                               a.request.bitmap, a.request.bitmap, a.image, image->format);
    co_return Status::errorf(ENOENT, "Operation {} on bitmap {} failed: Dirty bitmap '{}' not found",
                             image::bitmap_action_name(first.kind), a.request.bitmap, a.request.bitmap);
  }
  QCOWFS_CO_TRY(co_await read_merge_sources(a));
  co_return co_await format->bitmap->run(std::move(image->file), a.image, std::move(a.request));
}

}  // namespace

std::string_view bitmap_usage() {
  return "usage: qcowfs bitmap (--merge SOURCE | --add | --remove | --clear | --enable | --disable)...\n"
         "                     [-b SOURCE_FILE [-F SOURCE_FMT]] [-g GRANULARITY] [-f FMT]\n"
         "                     [--key-file PATH] IMAGE BITMAP\n"
         "\n"
         "Changes the persistent dirty bitmaps of a qcow2 image, like qemu-img bitmap (same\n"
         "command line, messages and exit status: 0, or 1 on error). The actions run in the\n"
         "order given, on bitmap BITMAP. The image is opened read-write with QEMU's locks,\n"
         "so an image a VM or a mount is using is refused.\n"
         "\n"
         "  --add                add BITMAP (enabled, empty)\n"
         "  --remove             remove BITMAP and free its clusters\n"
         "  --clear              clear every bit of BITMAP\n"
         "  --enable, --disable  start or stop BITMAP tracking writes\n"
         "  --merge SOURCE       set in BITMAP every bit set in bitmap SOURCE (of IMAGE, or\n"
         "                       of SOURCE_FILE with -b)\n"
         "  -b, --source-file=F  the image holding the --merge source bitmap\n"
         "  -F, --source-format=FMT  its format (default: probed)\n"
         "  -g, --granularity=N  --add's granularity (power of 2, 512 B to 2 GiB; default:\n"
         "                       the cluster size within 4 KiB..64 KiB)\n"
         "  -f, --format=FMT     image format (default: probed)\n"
         "  --key-file=PATH      passphrase of an encrypted image (the file's content, - for\n"
         "                       standard input; default: asked on the terminal)\n"
         "  -h, --help           show this text\n";
}

int cmd_bitmap(std::span<const std::string> args) {
  return run_tool("bitmap", bitmap_usage(), parse_bitmap_args(args), [](const BitmapArgs& a, io::Engine& engine) {
    Status st = io::run_sync(engine, bitmap(a));
    return st ? 0 : cmd_fail("bitmap", st);
  });
}

}  // namespace qcowfs::tools
