#include "image/path.h"

#include "io/remote/remote_options.h"

namespace qcowfs::image {

std::string resolve_relative(const std::string& image_path, const std::string& name) {
  if (name.empty() || name[0] == '/' || io::has_url_scheme(name)) return name;
  auto slash = image_path.rfind('/');
  return slash == std::string::npos ? name : image_path.substr(0, slash + 1) + name;
}

}  // namespace qcowfs::image
