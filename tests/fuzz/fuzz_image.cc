// libFuzzer target: a whole qcow2 image opened through the real driver over an
// in-memory MemFile (io/mem_file.h), then read: the start of the disk, sample
// points across it, block status, and every internal snapshot. Any Status is
// fine; crashes, sanitizer reports, hangs and memory blow-ups are not.
// Input: the image file's bytes.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

#include "image/block_driver.h"
#include "image/qcow2/qcow2.h"
#include "io/buffer.h"
#include "io/engine.h"
#include "io/mem_file.h"
#include "io/run_sync.h"

namespace io = qcowfs::io;
namespace image = qcowfs::image;
using qcowfs::Status;
using qcowfs::Task;

namespace {

constexpr uint64_t kChunk = 64 * 1024;
constexpr uint64_t kHeadBytes = 1 << 20;  // read the first MiB fully
constexpr int kSamples = 16;              // plus this many chunks spread over the disk
constexpr int kStatusQueries = 32;

io::Engine& engine() {
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

Task<void> read_some(image::BlockDriver& d) {
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

Task<void> fuzz_one(std::vector<std::byte> bytes) {
  io::MemFileOptions mo;
  mo.writable = false;
  mo.path = "/nonexistent-qcowfs-fuzz/fuzz.qcow2";
  auto file = std::make_unique<io::MemFile>(mo, std::move(bytes));
  image::ImageOptions opts;
  opts.table_cache_size = 64 * 1024;
  auto d = co_await image::open_qcow2(std::move(file), mo.path, opts);
  if (!d) co_return;
  co_await read_some(**d);
  for (const auto& s : (*d)->snapshots()) {
    auto view = co_await (*d)->open_snapshot(s.id);
    if (view) co_await read_some(**view);
  }
  (void)co_await (*d)->close();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::byte> bytes(reinterpret_cast<const std::byte*>(data), reinterpret_cast<const std::byte*>(data) + size);
  io::run_sync(engine(), fuzz_one(std::move(bytes)));
  return 0;
}
