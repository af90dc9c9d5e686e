// libFuzzer target: a whole qcow2 image opened through the real driver over an
// in-memory MemFile (io/mem_file.h), then read: the start of the disk, sample
// points across it, block status, and every internal snapshot. Any Status is
// fine; crashes, sanitizer reports, hangs and memory blow-ups are not.
// Input: the image file's bytes.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "image/block_driver.h"
#include "image/qcow2/qcow2.h"
#include "io/mem_file.h"
#include "io/run_sync.h"
#include "fuzz_driver.h"

namespace io = qcowfs::io;
namespace image = qcowfs::image;
using qcowfs::Status;
using qcowfs::Task;
namespace fuzz = qcowfs::fuzz;

namespace {

using fuzz::engine;
using fuzz::read_some;

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
