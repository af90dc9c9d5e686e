#include "image/backing.h"

#include <limits.h>
#include <stdlib.h>

#include <algorithm>
#include <cstring>

#include "image/path.h"
#include "image/shared_images.h"

namespace qcowfs::image {
namespace {

std::string real_path(const std::string& path) {
  char buf[PATH_MAX];
  if (::realpath(path.c_str(), buf) == nullptr) return path;
  return buf;
}

}  // namespace

Result<std::string> enter_backing_chain(const std::string& path, const ImageOptions& opts) {
  std::string self_real = real_path(path);
  if (std::find(opts.backing_chain.begin(), opts.backing_chain.end(), self_real) != opts.backing_chain.end())
    return Status::errorf(ELOOP, "backing chain loop: {} is its own backing file", self_real);
  return self_real;
}

Task<Result<std::unique_ptr<BlockDriver>>> open_backing_file(const std::string& overlay_path,
                                                            const std::string& name, const std::string& format,
                                                            const ImageOptions& overlay_opts) {
  std::string bpath = resolve_relative(overlay_path, name);
  ImageOptions b;
  b.format = format;
  b.file = overlay_opts.file;
  b.file.writable = false;
  b.table_cache_size = overlay_opts.table_cache_size;
  b.keys = overlay_opts.keys;  // one passphrase for the chain
  b.backing_chain = overlay_opts.backing_chain;
  b.backing_chain.push_back(real_path(overlay_path));
  b.backing_of = overlay_path;
  // Shared with every other overlay of the same file (and so is its own backing file).
  std::shared_ptr<SharedImages> shared = overlay_opts.shared_backing;
  b.shared_backing = shared;
  Result<std::unique_ptr<BlockDriver>> d = Status::error(EINVAL, "unopened");
  if (shared) d = co_await shared->open(bpath, std::move(b));
  else d = co_await open_image(bpath, std::move(b));
  if (!d) co_return d.status().with_context(fmt::format("opening backing file '{}' of {}", bpath, overlay_path));
  co_return d;
}

Task<Status> read_backing_range(BlockDriver& backing, uint64_t guest, std::span<std::byte> dst) {
  const uint64_t bsize = backing.size();
  const uint64_t n = guest < bsize ? std::min<uint64_t>(dst.size(), bsize - guest) : 0;
  if (n < dst.size()) std::memset(dst.data() + n, 0, dst.size() - n);
  if (n == 0) co_return Status::ok();
  co_return co_await backing.read(guest, dst.first(n));
}

}  // namespace qcowfs::image
