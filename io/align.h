// Alignment arithmetic: constexpr helpers used for host offsets, buffer
// addresses and cluster math alike. All alignments are powers of two.
// Thread-safety: pure functions.
#pragma once

#include <bit>
#include <cstdint>

namespace qcowfs {

constexpr bool is_pow2(uint64_t a) { return a != 0 && (a & (a - 1)) == 0; }
constexpr uint64_t align_down(uint64_t v, uint64_t a) { return v & ~(a - 1); }
constexpr uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) & ~(a - 1); }
constexpr bool is_aligned(uint64_t v, uint64_t a) { return (v & (a - 1)) == 0; }
inline bool is_aligned_ptr(const void* p, uint64_t a) {
  return is_aligned(reinterpret_cast<uintptr_t>(p), a);
}
constexpr uint64_t div_round_up(uint64_t v, uint64_t d) { return (v + d - 1) / d; }

static_assert(align_up(4097, 4096) == 8192);
static_assert(align_down(4097, 4096) == 4096);

}  // namespace qcowfs
