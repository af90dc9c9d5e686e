#include "image/extent/table_cache.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "image/endian.h"

namespace qcowfs::image {

bool TableCache::tiny() {
  static const bool tiny = [] {
    const char* v = std::getenv("QCOWFS_TINY_CACHE");
    return v != nullptr && *v != '\0' && std::string_view(v) != "0";
  }();
  return tiny;
}

uint64_t TableCache::default_size(uint64_t l2_bytes_for_whole_disk, size_t slice_size) {
  if (tiny()) return 2 * uint64_t{slice_size};
  return std::max<uint64_t>(std::min(l2_bytes_for_whole_disk, kDefaultMaxBytes), kDefaultMinSlices * uint64_t{slice_size});
}

static size_t slices_for(uint64_t bytes, size_t slice_size) {
  if (TableCache::tiny()) return 2;
  return static_cast<size_t>(std::max<uint64_t>(bytes / slice_size, 2));
}

TableCache::TableCache(io::HostFile& file, size_t slice_size, uint64_t capacity_bytes)
    : file_(file), slice_size_(slice_size), capacity_(slices_for(capacity_bytes, slice_size)) {}

// ---- Ref ----

TableCache::Ref::Ref(Ref&& o) noexcept
    : cache_(std::exchange(o.cache_, nullptr)), entry_(std::move(o.entry_)) {}

TableCache::Ref& TableCache::Ref::operator=(Ref&& o) noexcept {
  if (this != &o) {
    reset();
    cache_ = std::exchange(o.cache_, nullptr);
    entry_ = std::move(o.entry_);
  }
  return *this;
}

TableCache::Ref::~Ref() { reset(); }

void TableCache::Ref::reset() {
  if (entry_) cache_->unpin(*entry_);
  entry_.reset();
  cache_ = nullptr;
}

uint64_t TableCache::Ref::host_offset() const { return entry_->host; }
std::span<const std::byte> TableCache::Ref::bytes() const { return entry_->data; }
std::span<std::byte> TableCache::Ref::mutable_bytes() { return entry_->data; }

uint64_t TableCache::Ref::be64(size_t at) const { return load_be64(entry_->data.data() + at); }
uint64_t TableCache::Ref::le64(size_t at) const { return load_le64(entry_->data.data() + at); }
uint32_t TableCache::Ref::le32(size_t at) const { return load_le32(entry_->data.data() + at); }

// ---- cache ----

Task<Result<TableCache::Ref>> TableCache::get(uint64_t host) {
  std::shared_ptr<Entry> e;
  bool loader = false;
  {
    std::lock_guard lk(mu_);
    auto it = map_.find(host);
    if (it != map_.end()) {
      e = it->second;
      lru_.splice(lru_.begin(), lru_, e->lru);
    } else {
      evict_locked();
      e = std::make_shared<Entry>();
      e->host = host;
      lru_.push_front(host);
      e->lru = lru_.begin();
      map_.emplace(host, e);
      loader = true;
      ++host_reads_;
    }
    ++e->pins;
  }
  if (loader) {
    e->load_status = co_await load(*e);
    if (!e->load_status) {
      std::lock_guard lk(mu_);
      forget_locked(e);
    }
    e->loaded.set();
  } else {
    co_await e->loaded.wait();
  }
  if (!e->load_status) {
    unpin(*e);
    co_return e->load_status;
  }
  co_return Ref(this, std::move(e));
}

Result<TableCache::Ref> TableCache::try_get(uint64_t host) {
  std::shared_ptr<Entry> e;
  {
    std::lock_guard lk(mu_);
    auto it = map_.find(host);
    if (it == map_.end()) return Status::error(EAGAIN, "L2 slice not cached");
    e = it->second;
    // A slice still loading (or whose load failed) is left to get().
    if (!e->loaded.is_set() || !e->load_status.is_ok()) return Status::error(EAGAIN, "L2 slice not loaded");
    lru_.splice(lru_.begin(), lru_, e->lru);
    ++e->pins;
  }
  return Ref(this, std::move(e));
}

bool TableCache::try_read(uint64_t host, size_t at, std::span<std::byte> out) {
  std::lock_guard lk(mu_);
  auto it = map_.find(host);
  if (it == map_.end()) return false;
  Entry& e = *it->second;
  if (!e.loaded.is_set() || !e.load_status.is_ok()) return false;
  lru_.splice(lru_.begin(), lru_, e.lru);
  std::memcpy(out.data(), e.data.data() + at, out.size());
  return true;
}

Task<Status> TableCache::load(Entry& e) {
  if (slice_size_ >= io::kMinMemAlign) {
    e.aligned = io::AlignedBuffer(slice_size_, file_.mem_align(), false);
    e.data = e.aligned.span();
  } else {
    e.small.resize(slice_size_);
    e.data = e.small;
  }
  auto n = co_await file_.read(e.host, e.data);
  if (!n) co_return n.status().with_context(fmt::format("reading L2 slice at {:#x}", e.host));
  if (*n != slice_size_)
    co_return Status::errorf(EIO, "L2 slice at {:#x} is truncated by the end of the image file", e.host);
  co_return Status::ok();
}

void TableCache::evict_locked() {
  auto it = lru_.end();
  while (map_.size() >= capacity_ && it != lru_.begin()) {
    --it;
    auto m = map_.find(*it);
    Entry& e = *m->second;
    if (e.pins > 0 || e.dirty) continue;
    it = lru_.erase(it);
    map_.erase(m);
  }
}

void TableCache::forget_locked(const std::shared_ptr<Entry>& e) {
  auto it = map_.find(e->host);
  if (it == map_.end() || it->second != e) return;
  lru_.erase(e->lru);
  map_.erase(it);
}

void TableCache::unpin(Entry& e) {
  std::lock_guard lk(mu_);
  --e.pins;
}

void TableCache::mark_dirty(Ref& ref) {
  std::lock_guard lk(mu_);
  ref.entry_->dirty = true;
}

void TableCache::clear_dirty(Ref& ref) {
  std::lock_guard lk(mu_);
  ref.entry_->dirty = false;
}

size_t TableCache::cached_slices() const {
  std::lock_guard lk(mu_);
  return map_.size();
}

uint64_t TableCache::host_reads() const {
  std::lock_guard lk(mu_);
  return host_reads_;
}

}  // namespace qcowfs::image
