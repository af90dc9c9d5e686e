#include "io/iov.h"

#include <algorithm>
#include <cstring>

namespace qcowfs::io {

size_t iov_total(std::span<const iovec> iov) {
  size_t n = 0;
  for (const iovec& v : iov) n += v.iov_len;
  return n;
}

void copy_from_iov(std::byte* dst, std::span<const iovec> iov, size_t n) {
  for (const iovec& v : iov) {
    if (n == 0) return;
    size_t k = std::min(n, v.iov_len);
    std::memcpy(dst, v.iov_base, k);
    dst += k;
    n -= k;
  }
}

void copy_to_iov(std::span<const iovec> iov, const std::byte* src, size_t n) {
  for (const iovec& v : iov) {
    if (n == 0) return;
    size_t k = std::min(n, v.iov_len);
    std::memcpy(v.iov_base, src, k);
    src += k;
    n -= k;
  }
}

void IovCursor::advance(size_t n) {
  if (owned_.empty() || rest_.data() != owned_.data()) owned_.assign(rest_.begin(), rest_.end());
  size_t consumed = 0;
  while (consumed < owned_.size() && n >= owned_[consumed].iov_len) n -= owned_[consumed++].iov_len;
  owned_.erase(owned_.begin(), owned_.begin() + static_cast<std::ptrdiff_t>(consumed));
  if (n > 0 && !owned_.empty()) {
    owned_.front().iov_base = static_cast<std::byte*>(owned_.front().iov_base) + n;
    owned_.front().iov_len -= n;
  }
  rest_ = owned_;
}

}  // namespace qcowfs::io
