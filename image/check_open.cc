#include "image/check_open.h"

#include <memory>

#include "io/forwarding_file.h"

namespace qcowfs::image {

Task<Status> open_for_check(io::HostFile& file, const std::string& path, OpenFormatFn open) {
  ImageOptions opts;
  opts.file.writable = false;
  auto driver = co_await open(std::make_unique<io::ForwardingFile>(file), path, std::move(opts));
  if (!driver) co_return driver.status();
  co_return co_await (*driver)->close();
}

}  // namespace qcowfs::image
