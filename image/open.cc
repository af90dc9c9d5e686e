// open_image() and choose_format(): the one place that turns a named or probed
// format into its registry entry's driver (image/format.h), or refuses a format
// qcowfs only recognises.
#include "image/block_driver.h"
#include "image/copy_on_read.h"
#include "image/format.h"
#include "image/probe.h"

namespace qcowfs::image {

Task<Result<std::unique_ptr<BlockDriver>>> BlockDriver::open_snapshot(std::string id_or_name) {
  co_return Status::errorf(ENOENT, "{} images have no snapshot '{}'", format_name(), id_or_name);
}

Result<BitmapRun> BlockDriver::bitmap_run(std::string_view name, uint64_t, uint64_t) const {
  return Status::errorf(ENOENT, "Dirty bitmap '{}' not found", name);
}

Task<Result<std::string>> choose_format(io::HostFile& file, const std::string& path, std::string_view named,
                                        std::string_view backing_of) {
  const FormatInfo* f = nullptr;
  if (!named.empty()) {
    f = find_format(named);
    if (!f) co_return Status::errorf(EINVAL, "unknown image format '{}' (use {})", named, supported_format_names());
  } else {
    auto probed = co_await probe_format_info(file);
    if (!probed) co_return probed.status();
    f = *probed;
  }
  if (!f->supported() && !named.empty() && backing_of.empty()) {
    // A refused name given by the user, perhaps a typo (format=qcow for qcow2):
    // say what the file's bytes look like rather than advising format=raw.
    auto probed = co_await probe_format_info(file);
    if (probed && *probed != f) co_return named_format_mismatch(path, *f, **probed);
  }
  if (!f->supported()) co_return foreign_format_error(path, *f, !named.empty(), backing_of);
  co_return std::string(f->name);
}

Task<Result<std::unique_ptr<BlockDriver>>> open_image_file(std::unique_ptr<io::HostFile> file, std::string path,
                                                           ImageOptions opts) {
  auto format = co_await choose_format(*file, path, opts.format, opts.backing_of);
  if (!format) co_return format.status();
  if (opts.compress_writes && *format != "qcow2")
    co_return Status::errorf(EINVAL, "{}: compress=on is for qcow2 images (this one is {})", path, *format);
  const bool copy_on_read = opts.copy_on_read && opts.backing_of.empty();
  auto d = co_await find_format(*format)->open(std::move(file), std::move(path), std::move(opts));
  if (!d || !copy_on_read) co_return d;
  co_return make_copy_on_read(std::move(*d));
}

Task<Result<std::unique_ptr<BlockDriver>>> open_image(std::string path, ImageOptions opts) {
  auto file = io::open_host_file(path, opts.file);
  if (!file) co_return file.status();
  co_return co_await open_image_file(std::move(*file), std::move(path), std::move(opts));
}

}  // namespace qcowfs::image
