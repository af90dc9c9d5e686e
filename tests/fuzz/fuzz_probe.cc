// libFuzzer target: format detection (image/probe.h) over arbitrary bytes.
// Input: a whole small file; the head and tail are cut from it the way
// probe_format_info() reads them. Invariants: the answer is a table entry that
// find_format() knows by name, and it depends only on the probed bytes.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <vector>

#include "image/probe.h"

namespace img = qcowfs::image;

namespace {

void check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz_probe invariant broken: %s\n", what);
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const std::byte> file(reinterpret_cast<const std::byte*>(data), size);
  auto head = file.first(std::min(size, img::kProbeHeadBytes));
  std::span<const std::byte> tail;
  if (size >= img::kProbeTailBytes) tail = file.last(img::kProbeTailBytes);
  const img::FormatInfo& f = img::detect_format(head, tail);
  check(img::find_format(f.name) == &f, "detected format is not in the table");
  check(!f.display.empty(), "format without a display name");
  // Bytes past the head window must not matter: a longer head gives the same answer.
  const img::FormatInfo& again = img::detect_format(file.first(std::min(size, 2 * img::kProbeHeadBytes)), tail);
  check(&again == &f, "bytes beyond the probe window changed the answer");
  return 0;
}
