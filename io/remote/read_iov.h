// read_iov: a vectored read of a remote file done as one read() per iovec, in
// order, stopping at a short read (the end of the object). For remote files
// whose read() already splits, caches and overlaps by block (BlockCache,
// NbdFile), so one call per iovec costs no extra round trip.
// Thread-safety: as the read function's; the iovecs must outlive the task.
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <span>

#include "io/status.h"
#include "io/task.h"

namespace qcowfs::io {

// read(off, span<std::byte>) -> Task<Result<size_t>> (bytes read).
template <class Read>
Task<Result<size_t>> read_iov(uint64_t off, std::span<const iovec> iov, Read read) {
  size_t total = 0;
  for (const iovec& v : iov) {
    auto n = co_await read(off + total, std::span(static_cast<std::byte*>(v.iov_base), v.iov_len));
    if (!n) co_return n.status();
    total += *n;
    if (*n < v.iov_len) break;
  }
  co_return total;
}

}  // namespace qcowfs::io
