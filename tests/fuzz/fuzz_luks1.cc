// libFuzzer target: LUKS1 header parsing and key-slot unlock over arbitrary
// bytes. Input: the start of a LUKS1 image (the phdr, then key material); the
// image is the input followed by kSlackBytes of zeros. A header that parses is
// unlocked with the passphrase "x" when its iteration counts are small (the
// limits of crypto/luks1.h bound everything else: key material lies inside the
// image, stripes and key length are capped).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "image/crypto/luks1.h"

namespace c = qcowfs::image::crypto;

namespace {

// Zeros after the input, so key material may run past what the fuzzer gave.
constexpr uint64_t kSlackBytes = 64 << 10;
// Above this PBKDF2 count an input is parsed but not unlocked (speed only).
constexpr uint32_t kMaxFuzzIterations = 1000;

void check(bool ok, const char *what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz_luks1 invariant broken: %s\n", what);
    std::abort();
  }
}

bool cheap_to_unlock(const c::Luks1Header &h) {
  if (h.mk_digest_iter > kMaxFuzzIterations) return false;
  return std::none_of(h.slots.begin(), h.slots.end(),
                      [](const auto &s) { return s.enabled() && s.iterations > kMaxFuzzIterations; });
}

void check_parsed(const c::Luks1Header &h, uint64_t available) {
  check(h.key_bytes >= 1 && h.key_bytes <= c::kLuks1MaxKeyBytes, "key_bytes");
  check(h.spec.key_bytes() == h.key_bytes, "spec key length");
  for (const auto &s : h.slots) {
    check(s.stripes >= 1 && s.stripes <= c::kLuks1MaxStripes, "stripes");
    if (!s.enabled()) continue;
    // Over kMaxPbkdf2Iterations the slot is kept and skipped by unlock_luks1
    // (the header stays usable through its other slots); 0 is refused.
    check(s.iterations >= 1, "iterations");
    check(uint64_t{s.key_material_offset} * c::kLuks1SectorBytes + h.material_bytes(s) <= available,
          "key material past the image");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  std::span<const std::byte> in(reinterpret_cast<const std::byte *>(data), size);
  const uint64_t available = size + kSlackBytes;
  auto h = c::parse_luks1(in, available, "fuzz");
  if (!h) {
    check(h.status().code() == EINVAL, "parse error other than EINVAL");
    return 0;
  }
  check_parsed(*h, available);
  if (!cheap_to_unlock(*h)) return 0;
  c::ReadBytesFn read = [in](uint64_t offset, size_t length) -> qcowfs::Result<std::vector<std::byte>> {
    std::vector<std::byte> out(length, std::byte{0});
    if (offset < in.size()) {
      const size_t n = std::min<uint64_t>(length, in.size() - offset);
      std::memcpy(out.data(), in.data() + offset, n);
    }
    return out;
  };
  const char pass = 'x';
  auto key = c::unlock_luks1(*h, std::as_bytes(std::span(&pass, 1)), read, "fuzz");
  if (key) check(key->size() == h->key_bytes, "volume key length");
  return 0;
}
