// One qcow2 refcount entry inside a refcount block, at every refcount width:
// 2^order bits per entry, order 0..6 (1..64 bits). Entries of a byte or more
// are big-endian; narrower ones pack into bytes with entry 0 in the least
// significant bits (docs/interop/qcow2.txt, "Refcount blocks").
// Thread-safety: pure functions on the caller's buffer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace qcowfs::image::qcow2 {

// Entry `index` of `block`; the block must hold it.
uint64_t get_refcount_entry(std::span<const std::byte> block, uint64_t index, uint32_t order);
// Stores the low 2^order bits of value as entry `index`, leaving its neighbours alone.
void set_refcount_entry(std::span<std::byte> block, uint64_t index, uint32_t order, uint64_t value);

// Largest refcount a 2^order-bit entry holds.
constexpr uint64_t max_refcount(uint32_t order) {
  return order >= 6 ? ~uint64_t{0} : (uint64_t{1} << (uint64_t{1} << order)) - 1;
}

}  // namespace qcowfs::image::qcow2
