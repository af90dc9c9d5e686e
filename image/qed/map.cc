#include "image/qed/map.h"

#include <endian.h>

#include <algorithm>

#include "io/log.h"

namespace qcowfs::image::qed {
namespace {

uint64_t default_cache_bytes(const Header& h) {
  uint64_t clusters = h.image_size / h.cluster_size + 1;
  return TableCache::default_size(clusters * sizeof(uint64_t), TableCache::kDefaultSliceSize);
}

}  // namespace

QedMap::QedMap(io::HostFile& file, std::string path, const Header& header, std::vector<uint64_t> l1,
               uint64_t cache_bytes)
    : file_(file),
      path_(std::move(path)),
      h_(header),
      l1_(std::move(l1)),
      file_size_(header.file_size),
      cache_(file, TableCache::kDefaultSliceSize, cache_bytes != 0 ? cache_bytes : default_cache_bytes(header)) {}

uint64_t QedMap::l1_entry(uint64_t i) const {
  return std::atomic_ref<uint64_t>(const_cast<uint64_t&>(l1_[i])).load(std::memory_order_acquire);
}

void QedMap::set_l1_entry(uint64_t i, uint64_t l2) {
  std::atomic_ref<uint64_t>(l1_[i]).store(l2, std::memory_order_release);
}

uint64_t QedMap::load_entry(const TableCache::Ref& slice, size_t at) {
  auto* p = reinterpret_cast<uint64_t*>(const_cast<std::byte*>(slice.bytes().data() + at));  // NOLINT: 8-aligned
  return le64toh(std::atomic_ref<uint64_t>(*p).load(std::memory_order_acquire));
}

void QedMap::store_entry(TableCache::Ref& slice, size_t at, uint64_t entry) {
  auto* p = reinterpret_cast<uint64_t*>(slice.mutable_bytes().data() + at);  // NOLINT: 8-aligned
  std::atomic_ref<uint64_t>(*p).store(htole64(entry), std::memory_order_release);
}

void QedMap::grow_file(uint64_t end) {
  uint64_t now = file_size_.load(std::memory_order_relaxed);
  while (end > now && !file_size_.compare_exchange_weak(now, end, std::memory_order_release)) {
  }
}

Status QedMap::bad_entry(uint64_t entry, uint64_t guest) const {
  log::error("{}: invalid QED L2 entry {:#x} for guest offset {:#x}", path_, entry, guest);
  return Status::errorf(EIO, "{}: invalid QED L2 entry {:#x} for guest offset {:#x}", path_, entry, guest);
}

Result<uint64_t> QedMap::l2_table(uint64_t guest) const {
  const uint64_t index = guest >> h_.l1_shift;
  if (index >= l1_.size()) return Status::errorf(EIO, "{}: guest offset {:#x} is past the L1 table", path_, guest);
  const uint64_t l2 = l1_entry(index);
  if (l2 == kUnallocated) return l2;
  if (!h_.valid_table_offset(l2, file_size_.load(std::memory_order_acquire))) {
    log::error("{}: invalid QED L2 table offset {:#x} in L1 entry {} (guest offset {:#x})", path_, l2, index, guest);
    return Status::errorf(EIO, "{}: invalid QED L2 table offset {:#x} in L1 entry {} (guest offset {:#x})", path_, l2,
                          index, guest);
  }
  return l2;
}

// Unallocated from guest to the end of the run of empty L1 entries.
Extent QedMap::unallocated_l1_run(uint64_t guest, uint64_t len) const {
  uint64_t index = guest >> h_.l1_shift;
  uint64_t end = (index + 1) << h_.l1_shift;
  while (end - guest < len && index + 1 < l1_.size() && l1_entry(index + 1) == kUnallocated) {
    ++index;
    end = (index + 1) << h_.l1_shift;
  }
  Extent e;
  e.kind = ExtentKind::unallocated;
  e.length = std::min(len, end - guest);
  return e;
}

QedMap::EntryAt QedMap::entry_at(uint64_t l2, uint64_t guest) const {
  const uint64_t host = l2 + ((guest >> h_.l2_shift) & h_.l2_mask) * sizeof(uint64_t);
  const uint64_t slice = host & ~(uint64_t{TableCache::kDefaultSliceSize} - 1);
  return EntryAt{slice, static_cast<size_t>(host - slice)};
}

// The run of entries from `at` in the slice that QEMU would count as one
// (equal unallocated or zero entries, or data clusters that follow each other),
// within len guest bytes from guest.
Result<Extent> QedMap::scan(const TableCache::Ref& slice, size_t at, uint64_t guest, uint64_t len) const {
  const uint64_t first = load_entry(slice, at);
  const uint64_t file_bytes = file_size_.load(std::memory_order_acquire);
  Extent e;
  if (first == kUnallocated) {
    e.kind = ExtentKind::unallocated;
  } else if (first == kZeroCluster) {
    e.kind = ExtentKind::zero;
  } else if (h_.valid_cluster_offset(first, file_bytes)) {
    e.kind = ExtentKind::data;
    e.file = &file_;
    e.host_offset = first + (guest & h_.cluster_mask());
  } else {
    return bad_entry(first, guest);
  }
  const bool data = e.kind == ExtentKind::data;
  uint64_t length = h_.cluster_size - (guest & h_.cluster_mask());
  uint64_t expect = first;
  for (size_t i = at + sizeof(uint64_t); i < slice.bytes().size() && length < len; i += sizeof(uint64_t)) {
    if (data) expect += h_.cluster_size;
    uint64_t next = load_entry(slice, i);
    if (next != expect || (data && !h_.valid_cluster_offset(next, file_bytes))) break;
    length += h_.cluster_size;
  }
  e.length = std::min(len, length);
  return e;
}

Result<std::optional<Extent>> QedMap::try_map(uint64_t guest, uint64_t len) {
  auto l2 = l2_table(guest);
  if (!l2) return l2.status();
  if (*l2 == kUnallocated) return std::optional<Extent>(unallocated_l1_run(guest, len));
  const EntryAt where = entry_at(*l2, guest);
  auto slice = cache_.try_get(where.slice);
  if (!slice) return std::optional<Extent>();
  auto e = scan(*slice, where.at, guest, len);
  if (!e) return e.status();
  return std::optional<Extent>(*e);
}

Task<Result<Extent>> QedMap::map(uint64_t guest, uint64_t len) {
  auto l2 = l2_table(guest);
  if (!l2) co_return l2.status();
  if (*l2 == kUnallocated) co_return unallocated_l1_run(guest, len);
  const EntryAt where = entry_at(*l2, guest);
  auto slice = co_await cache_.get(where.slice);
  if (!slice) co_return slice.status().with_context(path_ + ": reading a QED L2 table");
  co_return scan(*slice, where.at, guest, len);
}

}  // namespace qcowfs::image::qed
