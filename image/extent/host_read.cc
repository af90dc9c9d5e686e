#include "image/extent/host_read.h"

#include <algorithm>
#include <cstring>

namespace qcowfs::image {

Task<Status> read_padded(io::HostFile& file, uint64_t off, std::span<std::byte> buf, std::string_view what) {
  if (buf.empty()) co_return Status::ok();
  const uint64_t size = file.size();
  const size_t want = off >= size ? 0 : static_cast<size_t>(std::min<uint64_t>(buf.size(), size - off));
  size_t got = 0;
  if (want > 0) {
    auto n = co_await file.read(off, buf.first(want));
    if (!n && what.empty())
      co_return n.status().with_context(fmt::format("reading {} bytes at {:#x} of {}", buf.size(), off, file.path()));
    if (!n) co_return n.status().with_context(fmt::format("{}: reading the {}", file.path(), what));
    got = *n;
  }
  if (got < buf.size()) std::memset(buf.data() + got, 0, buf.size() - got);
  co_return Status::ok();
}

}  // namespace qcowfs::image
