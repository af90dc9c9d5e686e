// iovec helpers for HostFile implementations: totals, gather/scatter copies
// between an iovec list and a flat buffer, and IovCursor, which walks an iovec
// list as short transfers consume it.
// Thread-safety: plain functions and values; an IovCursor belongs to one request.
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <span>
#include <vector>

namespace qcowfs::io {

size_t iov_total(std::span<const iovec> iov);
// Gathers the first n bytes described by iov into dst.
void copy_from_iov(std::byte* dst, std::span<const iovec> iov, size_t n);
// Scatters n bytes of src into the buffers described by iov.
void copy_to_iov(std::span<const iovec> iov, const std::byte* src, size_t n);

// The remaining part of an iovec list. Copies the list only when a transfer
// ends inside it (short I/O, or more segments than one syscall takes).
class IovCursor {
 public:
  explicit IovCursor(std::span<const iovec> iov) : rest_(iov) {}
  // At most max_segments of the remaining segments.
  std::span<const iovec> segments(size_t max_segments) const {
    return rest_.first(rest_.size() < max_segments ? rest_.size() : max_segments);
  }
  void advance(size_t n);

 private:
  std::span<const iovec> rest_;
  std::vector<iovec> owned_;  // backs rest_ after the first advance()
};

}  // namespace qcowfs::io
