#include "image/qcow2/l2_cache.h"

#include <algorithm>

#include "image/endian.h"

namespace qcowfs::image::qcow2 {

uint64_t L2Cache::default_size(uint64_t l2_bytes_for_whole_disk, size_t slice_size) {
#ifdef QCOWFS_TINY_CACHE
  (void)l2_bytes_for_whole_disk;
  return 2 * uint64_t{slice_size};
#else
  return std::max<uint64_t>(std::min(l2_bytes_for_whole_disk, kDefaultMaxBytes), kDefaultMinSlices * uint64_t{slice_size});
#endif
}

static size_t slices_for(uint64_t bytes, size_t slice_size) {
#ifdef QCOWFS_TINY_CACHE
  (void)bytes;
  (void)slice_size;
  return 2;
#else
  return static_cast<size_t>(std::max<uint64_t>(bytes / slice_size, 2));
#endif
}

L2Cache::L2Cache(io::HostFile& file, size_t slice_size, uint64_t capacity_bytes)
    : file_(file), slice_size_(slice_size), capacity_(slices_for(capacity_bytes, slice_size)) {}

// ---- Ref ----

L2Cache::Ref::Ref(Ref&& o) noexcept
    : cache_(std::exchange(o.cache_, nullptr)), entry_(std::move(o.entry_)) {}

L2Cache::Ref& L2Cache::Ref::operator=(Ref&& o) noexcept {
  if (this != &o) {
    reset();
    cache_ = std::exchange(o.cache_, nullptr);
    entry_ = std::move(o.entry_);
  }
  return *this;
}

L2Cache::Ref::~Ref() { reset(); }

void L2Cache::Ref::reset() {
  if (entry_) cache_->unpin(*entry_);
  entry_.reset();
  cache_ = nullptr;
}

HostOffset L2Cache::Ref::host_offset() const { return entry_->host; }
std::span<const std::byte> L2Cache::Ref::bytes() const { return entry_->data; }
std::span<std::byte> L2Cache::Ref::mutable_bytes() { return entry_->data; }

uint64_t L2Cache::Ref::entry(size_t i, size_t entry_size) const {
  return load_be64(entry_->data.data() + i * entry_size);
}

uint64_t L2Cache::Ref::bitmap(size_t i, size_t entry_size) const {
  return load_be64(entry_->data.data() + i * entry_size + sizeof(uint64_t));  // the word after the entry
}

// ---- cache ----

Task<Result<L2Cache::Ref>> L2Cache::get(HostOffset host) {
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

Result<L2Cache::Ref> L2Cache::try_get(HostOffset host) {
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

Task<Status> L2Cache::load(Entry& e) {
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

void L2Cache::evict_locked() {
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

void L2Cache::forget_locked(const std::shared_ptr<Entry>& e) {
  auto it = map_.find(e->host);
  if (it == map_.end() || it->second != e) return;
  lru_.erase(e->lru);
  map_.erase(it);
}

void L2Cache::unpin(Entry& e) {
  std::lock_guard lk(mu_);
  --e.pins;
}

void L2Cache::mark_dirty(Ref& ref) {
  std::lock_guard lk(mu_);
  ref.entry_->dirty = true;
}

void L2Cache::clear_dirty(Ref& ref) {
  std::lock_guard lk(mu_);
  ref.entry_->dirty = false;
}

size_t L2Cache::cached_slices() const {
  std::lock_guard lk(mu_);
  return map_.size();
}

uint64_t L2Cache::host_reads() const {
  std::lock_guard lk(mu_);
  return host_reads_;
}

}  // namespace qcowfs::image::qcow2
