#include <cerrno>

#include "io/host_file.h"

namespace qcowfs::io {

std::string_view to_string(CacheMode m) {
  switch (m) {
    case CacheMode::none: return "none";
    case CacheMode::writethrough: return "writethrough";
    case CacheMode::writeback: return "writeback";
    case CacheMode::unsafe: return "unsafe";
  }
  return "?";
}

Result<CacheMode> parse_cache_mode(std::string_view s) {
  for (CacheMode m : {CacheMode::none, CacheMode::writethrough, CacheMode::writeback, CacheMode::unsafe})
    if (s == to_string(m)) return m;
  return Status::errorf(EINVAL, "unknown cache mode '{}' (none, writethrough, writeback, unsafe)", s);
}

}  // namespace qcowfs::io
