// open_image() and format probing: the one place that picks a format driver.
#include <cstring>

#include "image/block_driver.h"
#include "image/qcow2.h"
#include "image/raw.h"
#include "io/log.h"

namespace qcowfs::image {

Task<Result<std::unique_ptr<BlockDriver>>> BlockDriver::open_snapshot(std::string id_or_name) {
  co_return Status::errorf(ENOENT, "{} images have no snapshot '{}'", format_name(), id_or_name);
}

Task<Result<std::string>> probe_format(io::HostFile& file) {
  std::byte magic[4] = {};
  auto n = co_await file.read(std::span<std::byte>(magic, sizeof magic), 0);
  if (!n) co_return n.status().with_context("probing format");
  if (*n == sizeof magic && std::memcmp(magic, "QFI\xfb", 4) == 0) co_return std::string("qcow2");
  co_return std::string("raw");
}

Task<Result<std::unique_ptr<BlockDriver>>> open_image(std::string path, ImageOptions opts) {
  auto file = io::open_host_file(path, opts.file);
  if (!file) co_return file.status();
  std::string format = opts.format;
  if (format.empty()) {
    auto probed = co_await probe_format(**file);
    if (!probed) co_return probed.status();
    format = *probed;
  }
  if (format == "qcow2") co_return co_await open_qcow2(std::move(*file), path, opts);
  if (format != "raw") co_return Status::errorf(EINVAL, "unknown image format '{}' (use raw or qcow2)", format);
  if (!opts.snapshot.empty()) co_return Status::error(EINVAL, "raw images have no snapshots");
  std::unique_ptr<BlockDriver> d = std::make_unique<RawDriver>(std::move(*file), opts.discard_unmap);
  co_return d;
}

}  // namespace qcowfs::image
