// AlignedBuffer: an owned, zero-initialised heap buffer aligned for direct I/O
// (default 4096 bytes; pass the host's mem_align() when larger).
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
  std::byte* data() { return data_.get(); }
  const std::byte* data() const { return data_.get(); }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  std::span<std::byte> span() { return {data_.get(), size_}; }
  std::span<const std::byte> span() const { return {data_.get(), size_}; }

 private:
  struct Free {
    void operator()(std::byte* p) const { std::free(p); }
  };
  std::unique_ptr<std::byte, Free> data_;
  size_t size_ = 0;
};

}  // namespace qcowfs::io
