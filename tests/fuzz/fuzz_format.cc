// libFuzzer target template: one image of the format QCOWFS_FUZZ_FORMAT (a
// registry name, set by tests/fuzz/CMakeLists.txt: fuzz_vdi, fuzz_vmdk, ...)
// opened through that format's driver over an in-memory MemFile, then read:
// the start of the disk, sample points across it, and block status; then, for
// the formats that open read-write, opened writable over a copy (which may
// grow by at most kGrowLimit) and written: a few chunks across the disk, a
// zeroed range, flush and close. Any Status is fine; crashes, sanitizer
// reports, hangs and memory blow-ups are not.
// Input: the image file's bytes (seeds: make_seeds.py FORMAT_IMAGES).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "image/block_driver.h"
#include "image/format.h"
#include "io/buffer.h"
#include "io/mem_file.h"
#include "io/run_sync.h"
#include "fuzz_driver.h"

#ifndef QCOWFS_FUZZ_FORMAT
#error "QCOWFS_FUZZ_FORMAT names the format (tests/fuzz/CMakeLists.txt)"
#endif

namespace io = qcowfs::io;
namespace image = qcowfs::image;
using qcowfs::Status;
using qcowfs::Task;
namespace fuzz = qcowfs::fuzz;

namespace {

using fuzz::engine;
using fuzz::kChunk;

constexpr uint64_t kGrowLimit = 16 << 20;  // a writable copy grows by at most this
constexpr int kWrites = 6;

Task<void> write_some(image::BlockDriver& d) {
  io::AlignedBuffer buf(kChunk, d.mem_align(), false);
  std::memset(buf.data(), 0x5a, buf.size());
  const uint64_t size = d.size();
  for (int i = 0; i < kWrites && size > 0; ++i) {
    const uint64_t off = (size / kWrites * static_cast<uint64_t>(i) + 512 * static_cast<uint64_t>(i)) % size;
    const uint64_t n = std::min(kChunk - 100 * static_cast<uint64_t>(i), size - off);
    (void)co_await d.write(off, buf.span().first(n));
  }
  if (size > 0) (void)co_await d.write_zeroes(size / 3, std::min<uint64_t>(3 * kChunk, size - size / 3), true);
  (void)co_await d.flush();
  if (size > 0) (void)co_await d.read(0, buf.span().first(std::min(kChunk, size)));
}

Task<void> fuzz_writable(const image::FormatInfo& f, std::vector<std::byte> bytes) {
  io::MemFileOptions mo;
  mo.path = "/nonexistent-qcowfs-fuzz/fuzz-rw." QCOWFS_FUZZ_FORMAT;
  const uint64_t limit = bytes.size() + kGrowLimit;
  auto file = std::make_unique<io::MemFile>(mo, std::move(bytes));
  file->set_size_limit(limit);
  image::ImageOptions opts;
  opts.format = QCOWFS_FUZZ_FORMAT;
  opts.table_cache_size = 64 * 1024;
  opts.file.writable = true;
  auto d = co_await f.open(std::move(file), mo.path, opts);
  if (!d) co_return;
  co_await write_some(**d);
  (void)co_await (*d)->close();
}

Task<void> fuzz_one(std::vector<std::byte> bytes) {
  const image::FormatInfo* f = image::find_format(QCOWFS_FUZZ_FORMAT);
  if (f == nullptr || !f->supported()) co_return;
  co_await fuzz_writable(*f, bytes);
  io::MemFileOptions mo;
  mo.writable = false;
  mo.path = "/nonexistent-qcowfs-fuzz/fuzz." QCOWFS_FUZZ_FORMAT;
  auto file = std::make_unique<io::MemFile>(mo, std::move(bytes));
  image::ImageOptions opts;
  opts.format = QCOWFS_FUZZ_FORMAT;
  opts.table_cache_size = 64 * 1024;
  auto d = co_await f->open(std::move(file), mo.path, opts);
  if (!d) co_return;
  co_await fuzz::read_some(**d);
  (void)(*d)->details();
  (void)co_await (*d)->close();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::byte> bytes(reinterpret_cast<const std::byte*>(data),
                               reinterpret_cast<const std::byte*>(data) + size);
  io::run_sync(engine(), fuzz_one(std::move(bytes)));
  return 0;
}
