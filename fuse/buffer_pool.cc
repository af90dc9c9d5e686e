#include "fuse/buffer_pool.h"

#include <algorithm>
#include <bit>

namespace qcowfs::fuse {

BufferPool::BufferPool(size_t buffer_size, size_t align, size_t max_idle)
    : size_(buffer_size), align_(align), max_idle_(max_idle) {}

io::AlignedBuffer BufferPool::take() {
  if (idle_.empty()) return io::AlignedBuffer::for_large_io(size_, align_);
  io::AlignedBuffer b = std::move(idle_.back());
  idle_.pop_back();
  return b;
}

void BufferPool::give(io::AlignedBuffer buf) {
  if (!buf.data() || buf.size() != size_ || idle_.size() >= max_idle_) return;  // freed here
  idle_.push_back(std::move(buf));
}

SizedBufferPool::SizedBufferPool(size_t align) : align_(align) {
  for (size_t s = kMinClass; s <= kMaxPooledSize; s <<= 1)
    classes_.emplace_back(s, align, kIdleBytes / s);
}

size_t SizedBufferPool::class_size(size_t size) { return std::bit_ceil(std::max(size, kMinClass)); }

io::AlignedBuffer SizedBufferPool::take(size_t size) {
  size_t cls = class_size(size);
  if (cls > kMaxPooledSize) return io::AlignedBuffer::for_large_io(size, align_);
  BufferPool& pool = classes_[static_cast<size_t>(std::countr_zero(cls / kMinClass))];
  if (pool.idle_count() > 0) idle_bytes_ -= cls;
  return pool.take();
}

void SizedBufferPool::give(io::AlignedBuffer buf) {
  size_t s = buf.size();
  // A power of two (s >= kMinClass > 0); std::has_single_bit is a libgcc
  // popcount call on the baseline x86-64 target, on every reply buffer.
  if (!buf.data() || s < kMinClass || s > kMaxPooledSize || (s & (s - 1)) != 0) return;
  if (idle_bytes_ + s > kIdleBytes) return;  // freed here
  BufferPool& pool = classes_[static_cast<size_t>(std::countr_zero(s / kMinClass))];
  size_t before = pool.idle_count();
  pool.give(std::move(buf));
  if (pool.idle_count() > before) idle_bytes_ += s;
}

size_t SizedBufferPool::idle_count() const {
  size_t n = 0;
  for (const auto& c : classes_) n += c.idle_count();
  return n;
}

}  // namespace qcowfs::fuse
