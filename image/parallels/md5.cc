#include "image/parallels/md5.h"

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>

#include "image/endian.h"

namespace qcowfs::image::parallels {
namespace {

constexpr std::array<uint32_t, 64> kShift = {7, 12, 17, 22, 7, 12, 17, 22, 7, 12, 17, 22, 7, 12, 17, 22,
                                             5, 9,  14, 20, 5, 9,  14, 20, 5, 9,  14, 20, 5, 9,  14, 20,
                                             4, 11, 16, 23, 4, 11, 16, 23, 4, 11, 16, 23, 4, 11, 16, 23,
                                             6, 10, 15, 21, 6, 10, 15, 21, 6, 10, 15, 21, 6, 10, 15, 21};

// floor(abs(sin(i + 1)) * 2^32)
constexpr std::array<uint32_t, 64> kTable = {
    0xd76aa478, 0xe8c7b756, 0x242070db, 0xc1bdceee, 0xf57c0faf, 0x4787c62a, 0xa8304613, 0xfd469501,
    0x698098d8, 0x8b44f7af, 0xffff5bb1, 0x895cd7be, 0x6b901122, 0xfd987193, 0xa679438e, 0x49b40821,
    0xf61e2562, 0xc040b340, 0x265e5a51, 0xe9b6c7aa, 0xd62f105d, 0x02441453, 0xd8a1e681, 0xe7d3fbc8,
    0x21e1cde6, 0xc33707d6, 0xf4d50d87, 0x455a14ed, 0xa9e3e905, 0xfcefa3f8, 0x676f02d9, 0x8d2a4c8a,
    0xfffa3942, 0x8771f681, 0x6d9d6122, 0xfde5380c, 0xa4beea44, 0x4bdecfa9, 0xf6bb4b60, 0xbebfbc70,
    0x289b7ec6, 0xeaa127fa, 0xd4ef3085, 0x04881d05, 0xd9d4d039, 0xe6db99e5, 0x1fa27cf8, 0xc4ac5665,
    0xf4292244, 0x432aff97, 0xab9423a7, 0xfc93a039, 0x655b59c3, 0x8f0ccc92, 0xffeff47d, 0x85845dd1,
    0x6fa87e4f, 0xfe2ce6e0, 0xa3014314, 0x4e0811a1, 0xf7537e82, 0xbd3af235, 0x2ad7d2bb, 0xeb86d391};

void block(std::array<uint32_t, 4>& s, const std::byte* p) {
  uint32_t m[16];
  for (int i = 0; i < 16; ++i) m[i] = load_le32(p + 4 * i);
  uint32_t a = s[0], b = s[1], c = s[2], d = s[3];
  for (uint32_t i = 0; i < 64; ++i) {
    uint32_t f, g;
    if (i < 16) {
      f = (b & c) | (~b & d);
      g = i;
    } else if (i < 32) {
      f = (d & b) | (~d & c);
      g = (5 * i + 1) % 16;
    } else if (i < 48) {
      f = b ^ c ^ d;
      g = (3 * i + 5) % 16;
    } else {
      f = c ^ (b | ~d);
      g = (7 * i) % 16;
    }
    const uint32_t t = d;
    d = c;
    c = b;
    b = b + std::rotl(a + f + kTable[i] + m[g], static_cast<int>(kShift[i]));
    a = t;
  }
  s[0] += a;
  s[1] += b;
  s[2] += c;
  s[3] += d;
}

}  // namespace

void Md5::update(std::span<const std::byte> data) {
  total_ += data.size();
  size_t i = 0;
  if (pending_len_ != 0) {
    const size_t n = std::min(data.size(), pending_.size() - pending_len_);
    std::memcpy(pending_.data() + pending_len_, data.data(), n);
    pending_len_ += n;
    i = n;
    if (pending_len_ < pending_.size()) return;
    block(state_, pending_.data());
    pending_len_ = 0;
  }
  for (; i + 64 <= data.size(); i += 64) block(state_, data.data() + i);
  pending_len_ = data.size() - i;
  if (pending_len_ != 0) std::memcpy(pending_.data(), data.data() + i, pending_len_);
}

std::array<std::byte, 16> Md5::digest() {
  std::byte tail[128] = {};
  const size_t rest = pending_len_;
  if (rest != 0) std::memcpy(tail, pending_.data(), rest);
  tail[rest] = std::byte{0x80};
  const size_t tail_len = rest < 56 ? 64 : 128;
  store_le64(tail + tail_len - 8, total_ * 8);
  for (size_t t = 0; t < tail_len; t += 64) block(state_, tail + t);
  std::array<std::byte, 16> out;
  for (size_t k = 0; k < 4; ++k) store_le32(out.data() + 4 * k, state_[k]);
  return out;
}

std::array<std::byte, 16> md5(std::span<const std::byte> data) {
  Md5 m;
  m.update(data);
  return m.digest();
}

}  // namespace qcowfs::image::parallels
