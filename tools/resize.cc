// qcowfs resize: changes an image's virtual size, with qemu-img resize's
// command line and messages: SIZE is absolute or relative (+N, -N) and always
// the last argument (so -16M is a size, not an option); shrinking needs
// --shrink; "Image resized." on success. The image is opened read-write with
// QEMU's locks (refused while a VM or a mount holds it) and resized through
// its driver (BlockDriver::truncate), so every format qcowfs writes can be
// grown, and shrunk where nothing but holes lies past the new end (data there
// is refused, never dropped).
#include <string>

#include "image/block_driver.h"
#include "image/create.h"
#include "image/crypto/secret.h"
#include "tools/cmd.h"

namespace qcowfs::tools {
namespace {

enum class SizeChange { absolute, grow, shrink };

struct ResizeArgs : ImageCommandArgs {
  SizeChange change = SizeChange::absolute;
  uint64_t amount = 0;
  bool shrink = false;
  bool quiet = false;
};

Status parse_size_argument(std::string_view text, ResizeArgs& a) {
  if (text.starts_with("+")) a.change = SizeChange::grow;
  if (text.starts_with("-")) a.change = SizeChange::shrink;
  if (a.change != SizeChange::absolute) text.remove_prefix(1);
  auto n = image::parse_create_size("size", text);
  if (!n)
    return Status::error(EINVAL,
                         "Parameter 'size' expects a non-negative number below 2^64\n"
                         "Optional suffix k, M, G, T, P or E means kilo-, mega-, giga-, tera-, peta-\n"
                         "and exabytes, respectively.");
  a.amount = *n;
  return Status::ok();
}

Result<ResizeArgs> parse_resize_args(std::span<const std::string> args) {
  ResizeArgs a;
  // The size is the last argument whatever it looks like (qemu-img takes it
  // off argv before parsing options, so that -16M is not an option).
  const bool wants_help = std::find(args.begin(), args.end(), "--help") != args.end() ||
                          std::find(args.begin(), args.end(), "-h") != args.end();
  if (wants_help) {
    a.help = true;
    return a;
  }
  if (args.size() < 2) return Status::error(EINVAL, "Not enough arguments (expected IMAGE and SIZE)");
  QCOWFS_TRY(parse_size_argument(args.back(), a));
  QCOWFS_TRY(parse_image_command(args.first(args.size() - 1), a, [&](std::span<const std::string> as, size_t& i) -> Result<bool> {
    if (as[i] == "-q" || as[i] == "--quiet") return a.quiet = true;
    if (as[i] == "--shrink") return a.shrink = true;
    if (as[i] == "--json" || as[i].starts_with("--output"))
      return Status::errorf(EINVAL, "unknown option '{}'", as[i]);
    return false;
  }));
  return a;
}

Result<uint64_t> new_size(const ResizeArgs& a, uint64_t current) {
  uint64_t size = a.amount;
  if (a.change == SizeChange::grow) {
    if (a.amount > ~uint64_t{0} - current) return Status::error(EFBIG, "Image size too large");
    size = current + a.amount;
  } else if (a.change == SizeChange::shrink) {
    if (a.amount >= current) return Status::error(EINVAL, "New image size must be positive");
    size = current - a.amount;
  }
  if (size == 0) return Status::error(EINVAL, "New image size must be positive");
  return size;
}

Task<Status> resize(const ResizeArgs& a) {
  image::ImageOptions o;
  o.format = a.format;
  o.file.writable = true;
  o.keys = key_provider(a.key_file);
  auto d = co_await image::open_image(a.image, o);
  if (!d) co_return d.status();
  image::BlockDriver& driver = **d;
  auto size = new_size(a, driver.size());
  Status st = size.status();
  if (size && *size < driver.size() && !a.shrink)
    st = Status::error(EINVAL,
                       "Use the --shrink option to perform a shrink operation.\n"
                       "warning: Shrinking an image will delete all data beyond the shrunken image's end. "
                       "Before performing such an operation, make sure there is no important data there.");
  if (st && *size != driver.size()) st = co_await driver.truncate(*size);
  Status closed = co_await driver.close();
  co_return st ? closed : st;
}

}  // namespace

std::string_view resize_usage() {
  return "usage: qcowfs resize [-f FORMAT] [--shrink] [-q] [--key-file PATH] IMAGE [+|-]SIZE\n"
         "\n"
         "Changes the virtual size of IMAGE as qemu-img resize does: SIZE is the new\n"
         "size, or with + or - the change (K, M, G, T, P, E suffixes). A smaller size\n"
         "needs --shrink, and is refused where data (not holes) lies past the new end:\n"
         "qcowfs never drops written data. The image is opened read-write with QEMU's\n"
         "locks, so an image a VM or a mount is using is refused.\n"
         "\n"
         "  -f, --format=FMT     image format (default: probed)\n"
         "  --shrink             allow the new size to be smaller\n"
         "  --key-file=PATH      passphrase of an encrypted image (the file's content, - for\n"
         "                       standard input; default: asked on the terminal)\n"
         "  -q, --quiet          do not print 'Image resized.'\n"
         "  -h, --help           show this text\n";
}

int cmd_resize(std::span<const std::string> args) {
  return run_tool("resize", resize_usage(), parse_resize_args(args), [](const ResizeArgs& a, io::Engine& engine) {
    Status st = io::run_sync(engine, resize(a));
    if (!st) return cmd_fail("resize", st);
    if (!a.quiet) fmt::print("Image resized.\n");
    return 0;
  });
}

}  // namespace qcowfs::tools
