// Reading as a mount does: fuse/'s read_task asks the driver for a mapped
// read (BlockDriver::map_read) and reads the host run itself, else it calls
// read(). Tests read every byte of an image both ways against qemu-img's.
// Thread-safety: one test thread (the engine's).
#pragma once

#include <sys/uio.h>

#include <algorithm>
#include <cstring>
#include <span>
#include <vector>

#include "image/block_driver.h"
#include "io/run_sync.h"

namespace qcowfs::image::testing {

// [off, off + dst.size()) as fuse/'s read_task reads it; *mapped counts the
// requests that went through a run.
inline Task<Status> read_as_mounted(BlockDriver& d, uint64_t off, std::span<std::byte> dst, size_t* mapped) {
  std::optional<MappedRead> run = d.map_read(off, dst.size());
  if (!run) co_return co_await d.read(off, dst);
  ++*mapped;
  const iovec one{dst.data(), dst.size()};
  Result<size_t> n = co_await run->file->readv(run->host_offset, {&one, 1});
  run.reset();
  if (!n) co_return n.status();
  if (*n < dst.size()) std::memset(dst.data() + *n, 0, dst.size() - *n);
  co_return Status::ok();
}

// The whole image in `chunk`-byte requests, one at a time (each request maps
// what the one before loaded); *mapped counts the runs.
inline Task<Result<std::vector<std::byte>>> read_all_as_mounted(BlockDriver& d, size_t chunk, size_t* mapped) {
  std::vector<std::byte> out(d.size());
  for (uint64_t off = 0; off < d.size();) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(chunk, d.size() - off));
    Status st = co_await read_as_mounted(d, off, std::span<std::byte>(out.data() + off, n), mapped);
    if (!st) co_return st;
    off += n;
  }
  co_return out;
}

}  // namespace qcowfs::image::testing
