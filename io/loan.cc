#include "io/loan.h"

#include <algorithm>

#include "io/buffer.h"

namespace qcowfs::io {
namespace {

constexpr size_t kZeroBytes = size_t{1} << 20;

// One megabyte of zeros for every loan of zeros, made on first use.
const std::byte* shared_zeros() {
  static const AlignedBuffer zeros(kZeroBytes, kMinMemAlign, true);
  return zeros.data();
}

}  // namespace

void Loan::add(const void* p, size_t n, std::shared_ptr<const void> hold) {
  if (n == 0) return;
  bytes += n;
  if (hold) holds.push_back(std::move(hold));
  if (!pieces.empty()) {
    iovec& last = pieces.back();
    if (static_cast<const std::byte*>(last.iov_base) + last.iov_len == p) {
      last.iov_len += n;
      return;
    }
  }
  pieces.push_back(iovec{const_cast<void*>(p), n});
}

void Loan::add_zeros(uint64_t n) {
  for (uint64_t left = n; left > 0;) {
    const size_t take = static_cast<size_t>(std::min<uint64_t>(left, kZeroBytes));
    // Not joined with the last piece: zeros repeat the same memory.
    bytes += take;
    pieces.push_back(iovec{const_cast<std::byte*>(shared_zeros()), take});
    left -= take;
  }
}

void Loan::append(Loan&& other) {
  for (const iovec& v : other.pieces) add(v.iov_base, v.iov_len);
  for (auto& h : other.holds) holds.push_back(std::move(h));
  other = Loan{};
}

}  // namespace qcowfs::io
