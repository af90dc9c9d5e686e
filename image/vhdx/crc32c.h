// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of every
// VHDX header, region table and log entry. Table-driven (slicing by 8).
// Thread-safety: pure functions over constant tables.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace qcowfs::image::vhdx {

// The running CRC register after feeding `data` to register `state`: no
// initial or final inversion (start with 0xFFFFFFFF, invert at the end).
uint32_t crc32c_update(uint32_t state, std::span<const std::byte> data);

// The standard CRC-32C of data (crc32c("123456789") == 0xE3069283).
inline uint32_t crc32c(std::span<const std::byte> data) { return ~crc32c_update(0xFFFFFFFFu, data); }

// The CRC-32C of `block` computed with the 4-byte checksum field at `at`
// taken as zeros, as every VHDX structure stores it.
uint32_t crc32c_with_zeroed_field(std::span<const std::byte> block, size_t at);

}  // namespace qcowfs::image::vhdx
