#include "io/buffer.h"

#include <sys/mman.h>

#include <cstdint>

#include "io/align.h"

namespace qcowfs::io {

void detail::BufferRelease::operator()(std::byte* p) const {
  if (mapped != 0) {
    ::munmap(p, mapped);
  } else {
    std::free(p);
  }
}

namespace {

// Maps `len` bytes (a multiple of kHugePageSize) at a kHugePageSize-aligned
// address: maps one huge page more than asked and unmaps the unaligned ends.
std::byte* map_huge_aligned(size_t len) {
  const size_t span = len + kHugePageSize;
  void* m = ::mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return nullptr;
  auto* base = static_cast<std::byte*>(m);
  const auto addr = reinterpret_cast<uintptr_t>(base);
  std::byte* p = base + (align_up(addr, kHugePageSize) - addr);
  if (p > base) ::munmap(base, static_cast<size_t>(p - base));
  std::byte* end = p + len;
  if (end < base + span) ::munmap(end, static_cast<size_t>(base + span - end));
  // Advice only: without THP the buffer simply keeps 4 KiB pages.
  ::madvise(p, len, MADV_HUGEPAGE);
  return p;
}

}  // namespace

AlignedBuffer AlignedBuffer::for_large_io(size_t size, size_t align) {
  if (size < kLargeIoBytes || align > kHugePageSize) return AlignedBuffer(size, align, /*zero=*/false);
  const size_t len = align_up(size, kHugePageSize);
  std::byte* p = map_huge_aligned(len);
  if (!p) throw std::bad_alloc();
  return AlignedBuffer(p, size, len);
}

}  // namespace qcowfs::io
