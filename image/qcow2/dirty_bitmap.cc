#include "image/qcow2/dirty_bitmap.h"

#include <algorithm>
#include <bit>

#include "image/endian.h"
#include "io/align.h"

namespace qcowfs::image::qcow2 {
namespace {

constexpr uint64_t kBitmapWordBits = 64;
constexpr uint64_t kBitmapWordBytes = 8;

uint64_t bitmap_bits_for(uint64_t disk_size, uint32_t granularity_bits) {
  return div_round_up(disk_size, uint64_t{1} << granularity_bits);
}

}  // namespace

DirtyBitmap::DirtyBitmap(uint64_t size, uint32_t gran_bits)
    : disk_size_(size),
      granularity_bits_(gran_bits),
      bits_(bitmap_bits_for(size, gran_bits)),
      words_(static_cast<size_t>(div_round_up(bits_, kBitmapWordBits)), 0) {}

void DirtyBitmap::set_bits(uint64_t first, uint64_t end) {
  while (first < end) {
    const uint64_t w = first / kBitmapWordBits, b = first % kBitmapWordBits;
    const uint64_t n = std::min(kBitmapWordBits - b, end - first);
    const uint64_t mask = n == kBitmapWordBits ? ~uint64_t{0} : ((uint64_t{1} << n) - 1) << b;
    words_[w] |= mask;
    first += n;
  }
}

void DirtyBitmap::set(uint64_t guest, uint64_t len) {
  if (len == 0 || guest >= disk_size_) return;
  const uint64_t end = std::min(disk_size_, guest + std::min(len, disk_size_ - guest));
  set_bits(guest >> granularity_bits_, std::min(bits_, div_round_up(end, uint64_t{1} << granularity_bits_)));
}

void DirtyBitmap::clear() { std::fill(words_.begin(), words_.end(), 0); }

void DirtyBitmap::merge(const DirtyBitmap& other) {
  const size_t n = std::min(words_.size(), other.words_.size());
  for (size_t i = 0; i < n; ++i) words_[i] |= other.words_[i];
  trim_tail();
}

void DirtyBitmap::trim_tail() {
  if (bits_ % kBitmapWordBits != 0 && !words_.empty()) words_.back() &= (uint64_t{1} << (bits_ % kBitmapWordBits)) - 1;
}

void DirtyBitmap::resize(uint64_t size) {
  disk_size_ = size;
  bits_ = bitmap_bits_for(size, granularity_bits_);
  words_.resize(static_cast<size_t>(div_round_up(bits_, kBitmapWordBits)), 0);
  trim_tail();
}

bool DirtyBitmap::empty() const {
  return std::all_of(words_.begin(), words_.end(), [](uint64_t w) { return w == 0; });
}

std::vector<DirtyRange> DirtyBitmap::dirty_ranges() const {
  std::vector<DirtyRange> out;
  const uint64_t g = uint64_t{1} << granularity_bits_;
  for (uint64_t bit = 0; bit < bits_;) {
    if (words_[bit / kBitmapWordBits] == 0 && bit % kBitmapWordBits == 0) {
      bit += kBitmapWordBits;
      continue;
    }
    if (!test(bit)) {
      ++bit;
      continue;
    }
    uint64_t end = bit + 1;
    while (end < bits_ && test(end)) ++end;
    const uint64_t start = bit * g;
    out.push_back(DirtyRange{start, std::min(disk_size_, end * g) - start});
    bit = end;
  }
  return out;
}

uint64_t DirtyBitmap::find_next(uint64_t bit, bool value, uint64_t end) const {
  while (bit < end) {
    uint64_t w = words_[static_cast<size_t>(bit / kBitmapWordBits)];
    if (!value) w = ~w;
    w &= ~uint64_t{0} << (bit % kBitmapWordBits);
    if (w != 0) return std::min(end, bit - bit % kBitmapWordBits + static_cast<uint64_t>(std::countr_zero(w)));
    bit += kBitmapWordBits - bit % kBitmapWordBits;
  }
  return end;
}

DirtyRun DirtyBitmap::run_at(uint64_t guest, uint64_t len) const {
  if (guest >= disk_size_ || len == 0) return {};
  const uint64_t stop = guest + std::min(len, disk_size_ - guest);
  const uint64_t bit = guest >> granularity_bits_;
  const bool dirty = test(bit);
  const uint64_t stop_bit = std::min(bits_, div_round_up(stop, uint64_t{1} << granularity_bits_));
  const uint64_t next = find_next(bit + 1, !dirty, stop_bit);
  const uint64_t end = std::min(stop, next << granularity_bits_);
  return DirtyRun{end - guest, dirty};
}

uint64_t DirtyBitmap::dirty_bytes() const {
  uint64_t set = 0;
  for (uint64_t w : words_) set += static_cast<uint64_t>(std::popcount(w));
  uint64_t bytes = set << granularity_bits_;
  // The last granule may end past the disk's end.
  if (bits_ != 0 && test(bits_ - 1)) bytes -= (bits_ << granularity_bits_) - disk_size_;
  return bytes;
}

bool DirtyBitmap::serialize_cluster(uint64_t index, std::span<std::byte> out) const {
  std::fill(out.begin(), out.end(), std::byte{0});
  const uint64_t words_per = out.size() / kBitmapWordBytes;
  const uint64_t first = index * words_per;
  bool any = false;
  for (uint64_t i = 0; i < words_per && first + i < words_.size(); ++i) {
    const uint64_t w = words_[static_cast<size_t>(first + i)];
    if (w == 0) continue;
    store_le64(out.data() + i * kBitmapWordBytes, w);
    any = true;
  }
  return any;
}

void DirtyBitmap::deserialize_cluster(uint64_t index, std::span<const std::byte> in) {
  const uint64_t words_per = in.size() / kBitmapWordBytes;
  const uint64_t first = index * words_per;
  for (uint64_t i = 0; i < words_per && first + i < words_.size(); ++i)
    words_[static_cast<size_t>(first + i)] = load_le64(in.data() + i * kBitmapWordBytes);
  trim_tail();
}

void DirtyBitmap::fill_cluster(uint64_t index, uint64_t cluster_size) {
  const uint64_t per = cluster_size * 8;
  const uint64_t first = index * per;
  if (first >= bits_) return;
  set_bits(first, std::min(bits_, first + per));
}

}  // namespace qcowfs::image::qcow2
