#include "image/describe.h"

#include "image/format.h"

namespace qcowfs::image {

Task<Result<ImageDescription>> describe_image(const FormatInfo& format, std::unique_ptr<io::HostFile> file,
                                              std::string path, ImageOptions opts) {
  opts.no_backing = true;
  if (format.describe != nullptr) co_return co_await format.describe(std::move(file), std::move(path), std::move(opts));
  if (format.open == nullptr) co_return Status::errorf(EMEDIUMTYPE, "{}: qcowfs does not read {} images", path, format.display);
  auto d = co_await format.open(std::move(file), path, std::move(opts));
  if (!d) co_return d.status();
  ImageDescription desc;
  desc.virtual_size = (*d)->size();
  desc.actual_size = (*d)->allocated_bytes();
  desc.details = (*d)->details();
  QCOWFS_CO_TRY(co_await (*d)->close());
  co_return desc;
}

}  // namespace qcowfs::image
