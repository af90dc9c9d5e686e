#include "image/extent/host_holes.h"

#include <algorithm>

namespace qcowfs::image {

Task<Status> apply_host_holes(io::HostFile& data_file, BlockStatus& st) {
  const uint64_t host = st.host_offset;
  const uint64_t end = data_file.size();
  if (host >= end) {
    st.zero = true;
    co_return Status::ok();
  }
  const uint64_t in_file = std::min(st.length, end - host);
  auto data = co_await data_file.seek_data(host);
  if (!data) co_return data.status();
  if (*data > host) {
    st.zero = true;
    // A hole reaching the end of the file covers the whole range (qemu's EOF rule).
    if (*data < end) st.length = std::min(in_file, *data - host);
    co_return Status::ok();
  }
  auto hole = co_await data_file.seek_hole(host);
  if (!hole) co_return hole.status();
  if (*hole > host) st.length = std::min(in_file, *hole - host);
  co_return Status::ok();
}

}  // namespace qcowfs::image
