#include "image/vhdx/crc32c.h"

#include <array>

#include "image/endian.h"

namespace qcowfs::image::vhdx {
namespace {

using Tables = std::array<std::array<uint32_t, 256>, 8>;

constexpr Tables make_tables() {
  Tables t{};
  for (uint32_t n = 0; n < 256; ++n) {
    uint32_t c = n;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    t[0][n] = c;
  }
  for (uint32_t n = 0; n < 256; ++n)
    for (size_t k = 1; k < 8; ++k) t[k][n] = (t[k - 1][n] >> 8) ^ t[0][t[k - 1][n] & 0xFF];
  return t;
}

constexpr Tables kTables = make_tables();

uint32_t byte_step(uint32_t c, std::byte b) { return kTables[0][(c ^ static_cast<uint8_t>(b)) & 0xFF] ^ (c >> 8); }

}  // namespace

uint32_t crc32c_update(uint32_t c, std::span<const std::byte> data) {
  const std::byte* p = data.data();
  size_t n = data.size();
  while (n >= 8) {
    const uint32_t lo = load_le32(p) ^ c;
    const uint32_t hi = load_le32(p + 4);
    c = kTables[7][lo & 0xFF] ^ kTables[6][(lo >> 8) & 0xFF] ^ kTables[5][(lo >> 16) & 0xFF] ^ kTables[4][lo >> 24] ^
        kTables[3][hi & 0xFF] ^ kTables[2][(hi >> 8) & 0xFF] ^ kTables[1][(hi >> 16) & 0xFF] ^ kTables[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  for (; n > 0; --n) c = byte_step(c, *p++);
  return c;
}

uint32_t crc32c_with_zeroed_field(std::span<const std::byte> block, size_t at) {
  constexpr std::byte kZeros[4] = {};
  uint32_t c = crc32c_update(0xFFFFFFFFu, block.first(at));
  c = crc32c_update(c, kZeros);
  c = crc32c_update(c, block.subspan(at + 4));
  return ~c;
}

}  // namespace qcowfs::image::vhdx
