// MD5 (RFC 1321), for the checksum of the Parallels format extension cluster
// (QEMU checks it with qcrypto_hash_bytes(QCRYPTO_HASH_ALG_MD5)). Not for
// security. Thread-safety: an Md5 is one caller's; md5() is pure.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

namespace qcowfs::image::parallels {

// Incremental: update() with the bytes in order, then digest() once.
class Md5 {
 public:
  void update(std::span<const std::byte> data);
  std::array<std::byte, 16> digest();

 private:
  std::array<uint32_t, 4> state_ = {0x67452301, 0xefcdab89, 0x98badcfe, 0x10325476};
  std::array<std::byte, 64> pending_{};
  size_t pending_len_ = 0;
  uint64_t total_ = 0;
};

std::array<std::byte, 16> md5(std::span<const std::byte> data);

}  // namespace qcowfs::image::parallels
