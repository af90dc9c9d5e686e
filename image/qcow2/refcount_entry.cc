#include "image/qcow2/refcount_entry.h"

#include "image/endian.h"

namespace qcowfs::image::qcow2 {

uint64_t get_refcount_entry(std::span<const std::byte> block, uint64_t index, uint32_t order) {
  if (order >= 3) {
    const std::byte* p = block.data() + (index << (order - 3));
    switch (order) {
      case 3: return std::to_integer<uint64_t>(*p);
      case 4: return load_be16(p);
      case 5: return load_be32(p);
      default: return load_be64(p);
    }
  }
  uint64_t bit = index << order;
  auto byte = std::to_integer<uint64_t>(block[bit / 8]);
  return (byte >> (bit % 8)) & max_refcount(order);
}

void set_refcount_entry(std::span<std::byte> block, uint64_t index, uint32_t order, uint64_t value) {
  if (order >= 3) {
    std::byte* p = block.data() + (index << (order - 3));
    switch (order) {
      case 3: *p = static_cast<std::byte>(value); return;
      case 4: store_be16(p, static_cast<uint16_t>(value)); return;
      case 5: store_be32(p, static_cast<uint32_t>(value)); return;
      default: store_be64(p, value); return;
    }
  }
  uint64_t bit = index << order;
  auto shift = static_cast<unsigned>(bit % 8);
  auto mask = static_cast<unsigned>(max_refcount(order) << shift);
  auto byte = std::to_integer<unsigned>(block[bit / 8]);
  byte = (byte & ~mask) | ((static_cast<unsigned>(value) << shift) & mask);
  block[bit / 8] = static_cast<std::byte>(byte);
}

}  // namespace qcowfs::image::qcow2
