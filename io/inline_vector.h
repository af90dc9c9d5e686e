// InlineVector<T, N>: a vector that holds its first N elements inside itself
// and moves them to a std::vector on the heap only when it grows past N.
// For per-request lists that almost always have one or two entries (the
// qcow2 writer's Plan), where a std::vector's malloc/free pair per request
// would be most of the list's cost. Only what such lists need: push_back,
// indexing, iteration over a contiguous range, clear. Not copyable or
// movable (its elements may live inside it); references stay valid until the
// next push_back or clear, as with std::vector.
//
// Thread-safety: none (one owner), like std::vector.
#pragma once

#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

namespace qcowfs {

template <class T, size_t N>
class InlineVector {
  static_assert(N > 0);

 public:
  InlineVector() = default;
  InlineVector(const InlineVector&) = delete;
  InlineVector& operator=(const InlineVector&) = delete;
  ~InlineVector() { clear(); }

  size_t size() const { return on_heap_ ? heap_.size() : inline_size_; }
  bool empty() const { return size() == 0; }
  T* data() { return on_heap_ ? heap_.data() : inline_at(0); }
  const T* data() const { return on_heap_ ? heap_.data() : inline_at(0); }
  T* begin() { return data(); }
  T* end() { return data() + size(); }
  const T* begin() const { return data(); }
  const T* end() const { return data() + size(); }
  T& operator[](size_t i) { return data()[i]; }
  const T& operator[](size_t i) const { return data()[i]; }
  T& back() { return data()[size() - 1]; }
  const T& back() const { return data()[size() - 1]; }

  // Room for n elements (moves to the heap when n > N).
  void reserve(size_t n) {
    if (on_heap_) {
      heap_.reserve(n);
    } else if (n > N) {
      spill(n);
    }
  }

  void push_back(T&& v) {
    if (!on_heap_) {
      if (inline_size_ < N) {
        std::construct_at(inline_at(inline_size_), std::move(v));
        ++inline_size_;
        return;
      }
      spill(2 * N);
    }
    heap_.push_back(std::move(v));
  }

  // Destroys every element; the inline room is used again afterwards.
  void clear() {
    std::destroy_n(inline_at(0), inline_size_);
    inline_size_ = 0;
    heap_.clear();
    on_heap_ = false;
  }

 private:
  T* inline_at(size_t i) { return reinterpret_cast<T*>(storage_) + i; }
  const T* inline_at(size_t i) const { return reinterpret_cast<const T*>(storage_) + i; }

  // Moves the inline elements to the heap vector, with room for `capacity`.
  void spill(size_t capacity) {
    heap_.reserve(capacity);
    for (size_t i = 0; i < inline_size_; ++i) heap_.push_back(std::move(*inline_at(i)));
    std::destroy_n(inline_at(0), inline_size_);
    inline_size_ = 0;
    on_heap_ = true;
  }

  alignas(T) std::byte storage_[sizeof(T) * N];
  size_t inline_size_ = 0;  // elements constructed in storage_ (0 while on_heap_)
  bool on_heap_ = false;
  std::vector<T> heap_;
};

}  // namespace qcowfs
