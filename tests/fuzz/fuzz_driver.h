// Shared pieces of the libFuzzer targets that open a whole image through a
// driver (fuzz_image.cc for qcow2, fuzz_format.cc for the other formats): the
// process-wide threads engine they run on and read_some(), which reads the
// start of the disk, sample points across it and walks block status. Header
// only: each target is one translation unit of its own. Not thread-safe: a
// fuzz target runs one input at a time.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>

#include "io/task.h"
#include "image/block_driver.h"
#include "io/buffer.h"
#include "io/engine.h"

namespace qcowfs::fuzz {

inline constexpr uint64_t kChunk = 64 * 1024;
inline constexpr uint64_t kHeadBytes = 1 << 20;  // read the first MiB fully
inline constexpr int kSamples = 16;              // plus this many chunks spread over the disk
inline constexpr int kStatusQueries = 32;

// The threads engine every input runs on, made on first use; aborts if none can be made.
inline io::Engine& engine() {
  static std::unique_ptr<io::Engine> e = [] {
    auto r = io::make_engine(io::EngineKind::threads);
    if (!r) {
      std::fprintf(stderr, "no engine: %s\n", r.status().to_string().c_str());
      std::abort();
    }
    return std::move(*r);
  }();
  return *e;
}

// Reads the first kHeadBytes, kSamples chunks spread over the disk, and up to
// kStatusQueries block-status extents from the start; every Status is ignored.
inline Task<void> read_some(image::BlockDriver& d) {
  io::AlignedBuffer buf(kChunk, d.mem_align(), false);
  const uint64_t size = d.size();
  for (uint64_t off = 0; off < size && off < kHeadBytes; off += kChunk) {
    uint64_t n = std::min(kChunk, size - off);
    (void)co_await d.read(off, buf.span().first(n));
  }
  for (int i = 1; i <= kSamples && size > 0; ++i) {
    uint64_t off = size / (kSamples + 1) * static_cast<uint64_t>(i);
    uint64_t n = std::min(kChunk, size - off);
    if (n > 0) (void)co_await d.read(off, buf.span().first(n));
  }
  uint64_t off = 0;
  for (int i = 0; i < kStatusQueries && off < size; ++i) {
    auto st = co_await d.block_status(off, size - off);
    if (!st || st->length == 0) break;
    off += st->length;
  }
}

}  // namespace qcowfs::fuzz
