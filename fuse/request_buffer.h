// Layout of the buffers /dev/fuse requests are read into.
//
// The kernel needs each read buffer to hold max_write plus the request
// headers. We place the read so that a WRITE's payload, which follows
// fuse_in_header (40 bytes) and fuse_write_in (40 bytes), starts exactly at
// base + 4096: the payload is then aligned for O_DIRECT and goes to the host
// without a copy. A large write keeps the whole buffer until its host write
// completes; a small one is copied out instead, so a megabyte buffer is not
// tied up (and reallocated) for every 4 KiB write at a high queue depth
// (see EventLoop::hold_write_payload()).
//
//   base            base + 4096 - 80       base + 4096
//   |   unused       | in_header | write_in | payload (<= kMaxWrite) ... | slack |
//
// Thread-safety: constants and pure functions.
#pragma once

#include <cstddef>

#include "io/buffer.h"

namespace qcowfs::fuse {

constexpr size_t kMaxWrite = size_t{1} << 20;  // what init asks for (libfuse 3.14's maximum)
constexpr size_t kWriteHeaderBytes = 80;       // fuse_in_header + fuse_write_in
constexpr size_t kPayloadAlign = 4096;
constexpr size_t kReadOffset = kPayloadAlign - kWriteHeaderBytes;
constexpr size_t kRequestBufferSize = kMaxWrite + 8192;
// Write payloads up to this size are copied out of the request buffer.
constexpr size_t kCopyWriteMax = 64 * 1024;

inline std::byte* request_read_start(io::AlignedBuffer& b) { return b.data() + kReadOffset; }
inline size_t request_read_capacity(const io::AlignedBuffer& b) { return b.size() - kReadOffset; }

}  // namespace qcowfs::fuse
