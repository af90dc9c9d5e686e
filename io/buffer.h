// AlignedBuffer: an owned buffer aligned for direct I/O (default 4096 bytes;
// pass the host's mem_align() when larger), zero-initialised unless asked not to.
// AlignedBuffer::for_large_io() backs megabyte buffers with transparent huge
// pages where the kernel allows (see there).
// Thread-safety: a plain owned value; move it between threads freely.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <span>

namespace qcowfs::io {

constexpr size_t kMinMemAlign = 4096;
// Transparent huge page size on x86-64 and arm64 with 4 KiB pages.
constexpr size_t kHugePageSize = size_t{2} << 20;
// for_large_io() uses huge pages from this size up.
constexpr size_t kLargeIoBytes = size_t{1} << 20;

namespace detail {
// Frees heap memory, or unmaps `mapped` bytes when the buffer was mapped.
struct BufferRelease {
  size_t mapped;
  void operator()(std::byte* p) const;
};
}  // namespace detail

class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(size_t size, size_t align = kMinMemAlign, bool zero = true) : size_(size) {
    if (align < kMinMemAlign) align = kMinMemAlign;
    size_t alloc = (size + align - 1) / align * align;
    if (alloc == 0) alloc = align;
    void* p = std::aligned_alloc(align, alloc);
    if (!p) throw std::bad_alloc();
    if (zero) std::memset(p, 0, alloc);
    data_.reset(static_cast<std::byte*>(p));
  }

  // A buffer (contents unspecified) for transfers of a megabyte and more.
  // From kLargeIoBytes up its memory is a private mapping aligned to
  // kHugePageSize and advised MADV_HUGEPAGE, so each 2 MiB is (when the kernel
  // finds a huge page) physically contiguous: an O_DIRECT transfer from it is
  // one DMA segment per 2 MiB instead of one per 4 KiB page. A virtio disk
  // limited to ~254 segments per request and a 256-descriptor queue then takes
  // several megabyte requests at once instead of one or two. Smaller sizes
  // give an ordinary heap buffer; with THP disabled the mapping keeps 4 KiB
  // pages. Memory: the mapping is rounded up to 2 MiB, all of it resident once
  // touched (a huge page is allocated whole).
  static AlignedBuffer for_large_io(size_t size, size_t align = kMinMemAlign);

  std::byte* data() { return data_.get(); }
  const std::byte* data() const { return data_.get(); }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  std::span<std::byte> span() { return {data_.get(), size_}; }
  std::span<const std::byte> span() const { return {data_.get(), size_}; }

 private:
  AlignedBuffer(std::byte* mapped, size_t size, size_t mapped_len)
      : data_(mapped, detail::BufferRelease{mapped_len}), size_(size) {}

  std::unique_ptr<std::byte, detail::BufferRelease> data_{nullptr, detail::BufferRelease{0}};
  size_t size_ = 0;
};

}  // namespace qcowfs::io
