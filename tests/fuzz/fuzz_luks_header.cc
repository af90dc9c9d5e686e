// libFuzzer target: LUKS1/LUKS2 binary header parsing (parse_luks_header) over
// arbitrary bytes and, for a header the parser accepts, libcryptsetup loading
// it from memory (LuksVolume::open_bytes, as for the LUKS area of a qcow2
// image) and the info it reports. Never unlocks (no key derivation).
// Input: the start of a LUKS header area (the whole area when it should load).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>

#include "image/crypto/luks.h"

namespace c = qcowfs::image::crypto;

namespace {

void check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz_luks_header invariant broken: %s\n", what);
    std::abort();
  }
}

// What the parser promised about a header it accepted.
void check_parsed(const c::LuksInfo& info, size_t size) {
  check(info.version == 1 || info.version == 2, "version");
  if (info.version == 1) {
    check(info.slots.size() == c::kLuks1KeySlots, "LUKS1 slot count");
    check(info.key_bytes > 0 && info.key_bytes <= c::kLuks1MaxKeyBytes, "key length");
    check(info.master_key_iterations > 0 && info.master_key_iterations <= c::kMaxPbkdf2Iterations, "mk iterations");
    for (const auto& s : info.slots) {
      check(s.stripes >= 1 && s.stripes <= c::kLuks1MaxStripes, "stripes");
      check(s.key_offset + s.key_length <= info.payload_offset, "key material before the payload");
      if (s.active) check(s.key_offset + s.key_length <= size, "active key material inside the input");
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const std::byte> in(reinterpret_cast<const std::byte*>(data), size);
  auto info = c::parse_luks_header(in, size, "fuzz");
  if (!info) return 0;
  check_parsed(*info, size);
  auto volume = c::LuksVolume::open_bytes(in, "fuzz");
  if (!volume) return 0;
  const c::LuksInfo& seen = volume->info();
  check(seen.version == info->version, "libcryptsetup loaded another LUKS version");
  for (const auto& s : seen.slots) (void)c::check_luks_slot_limits(s, "fuzz");
  return 0;
}
