// Load/store helpers: the one place image code converts between on-disk byte
// order and host integers, big-endian (qcow2, VHD) and little-endian (QED,
// VMDK, VHDX, VDI, Parallels). Work on unaligned byte pointers.
// Thread-safety: pure functions.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace qcowfs::image {

// std::byteswap is C++23; the compiler builtins are what it compiles to.
inline uint8_t bswap(uint8_t v) { return v; }
inline uint16_t bswap(uint16_t v) { return __builtin_bswap16(v); }
inline uint32_t bswap(uint32_t v) { return __builtin_bswap32(v); }
inline uint64_t bswap(uint64_t v) { return __builtin_bswap64(v); }

template <typename T>
inline T load_be(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  if constexpr (std::endian::native == std::endian::little) v = bswap(v);
  return v;
}

template <typename T>
inline void store_be(std::byte* p, T v) {
  if constexpr (std::endian::native == std::endian::little) v = bswap(v);
  std::memcpy(p, &v, sizeof v);
}

inline uint16_t load_be16(const std::byte* p) { return load_be<uint16_t>(p); }
inline uint32_t load_be32(const std::byte* p) { return load_be<uint32_t>(p); }
inline uint64_t load_be64(const std::byte* p) { return load_be<uint64_t>(p); }
inline void store_be16(std::byte* p, uint16_t v) { store_be(p, v); }
inline void store_be32(std::byte* p, uint32_t v) { store_be(p, v); }
inline void store_be64(std::byte* p, uint64_t v) { store_be(p, v); }

template <typename T>
inline T load_le(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  if constexpr (std::endian::native == std::endian::big) v = bswap(v);
  return v;
}

template <typename T>
inline void store_le(std::byte* p, T v) {
  if constexpr (std::endian::native == std::endian::big) v = bswap(v);
  std::memcpy(p, &v, sizeof v);
}

inline uint16_t load_le16(const std::byte* p) { return load_le<uint16_t>(p); }
inline uint32_t load_le32(const std::byte* p) { return load_le<uint32_t>(p); }
inline uint64_t load_le64(const std::byte* p) { return load_le<uint64_t>(p); }
inline void store_le16(std::byte* p, uint16_t v) { store_le(p, v); }
inline void store_le32(std::byte* p, uint32_t v) { store_le(p, v); }
inline void store_le64(std::byte* p, uint64_t v) { store_le(p, v); }

}  // namespace qcowfs::image
