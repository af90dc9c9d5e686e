#include "io/remote/disk_cache.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <iterator>

#include "io/log.h"

namespace qcowfs::io {
namespace {

namespace fs = std::filesystem;

constexpr uint32_t kRecordMagic = 0x31434351;  // "QCC1"
constexpr std::string_view kMetaHeader = "qcowfs remote cache 1\n";
// Blocks waiting to be written beyond this are not kept (the worker is behind).
constexpr uint64_t kMaxQueuedBytes = 64u << 20;

uint32_t crc_of(std::span<const std::byte> b) {
  return static_cast<uint32_t>(::crc32_z(0, reinterpret_cast<const Bytef*>(b.data()), b.size()));
}

// The URL without user info, query and fragment: what names the entry.
std::string cache_key(const std::string& url) {
  std::string key = url.substr(0, url.find_first_of("?#"));
  const size_t scheme = key.find("://");
  if (scheme == std::string::npos) return key;
  const size_t host = scheme + 3;
  const size_t at = key.find('@', host);
  if (at != std::string::npos && at < key.find('/', host)) key.erase(host, at + 1 - host);
  return key;
}

std::string meta_text(const ObjectIdentity& id, uint64_t block_size) {
  return fmt::format("{}url {}\nsize {}\netag {}\nlast-modified {}\nblock-size {}\n", kMetaHeader,
                     cache_key(id.url), id.size, id.etag, id.last_modified, block_size);
}

Result<UniqueFd> open_file(const std::string& path, int flags) {
  UniqueFd fd(::open(path.c_str(), flags | O_CLOEXEC, 0600));
  if (!fd.valid()) return Status::from_errno(errno, path);
  return fd;
}

Status pread_full(int fd, std::span<std::byte> dst, uint64_t off, const std::string& what) {
  size_t done = 0;
  while (done < dst.size()) {
    ssize_t n = ::pread(fd, dst.data() + done, dst.size() - done, static_cast<off_t>(off + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Status::from_errno(errno, what);
    if (n == 0) return Status::errorf(EIO, "{}: short read at {}", what, off + done);
    done += static_cast<size_t>(n);
  }
  return Status::ok();
}

Status pwrite_full(int fd, std::span<const std::byte> src, uint64_t off, const std::string& what) {
  size_t done = 0;
  while (done < src.size()) {
    ssize_t n = ::pwrite(fd, src.data() + done, src.size() - done, static_cast<off_t>(off + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Status::from_errno(errno, what);
    done += static_cast<size_t>(n);
  }
  return Status::ok();
}

// The whole (small) file, or "" when it does not exist.
Result<std::string> read_small(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) {
    if (errno == ENOENT) return std::string();
    return Status::from_errno(errno, path);
  }
  std::string out;
  char buf[4096];
  for (;;) {
    ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Status::from_errno(errno, path);
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
    if (out.size() > 64 * 1024) break;  // not a meta file of ours
  }
  return out;
}

// Writes text to path atomically (a temporary file, synced, renamed).
Status replace_file(const std::string& path, std::string_view text) {
  const std::string tmp = path + ".tmp";
  auto fd = open_file(tmp, O_WRONLY | O_CREAT | O_TRUNC);
  if (!fd) return fd.status();
  QCOWFS_TRY(pwrite_full(fd->get(), std::as_bytes(std::span(text.data(), text.size())), 0, tmp));
  if (::fsync(fd->get()) != 0) return Status::from_errno(errno, tmp);
  if (::rename(tmp.c_str(), path.c_str()) != 0) return Status::from_errno(errno, path);
  return Status::ok();
}

Status make_dir(const std::string& path) {
  if (::mkdir(path.c_str(), 0700) != 0 && errno != EEXIST) return Status::from_errno(errno, path);
  return Status::ok();
}

// Bytes an entry folder takes on the disk.
uint64_t disk_usage(const fs::path& dir) {
  uint64_t total = 0;
  for (const char* f : {"data", "map", "meta"}) {
    struct stat st {};
    if (::stat((dir / f).c_str(), &st) == 0) total += static_cast<uint64_t>(st.st_blocks) * 512;
  }
  return total;
}

struct OtherEntry {
  fs::path dir;
  uint64_t bytes = 0;
  int64_t last_used = 0;  // mtime of its lock file (touched at every open)
};

std::vector<OtherEntry> other_entries(const std::string& root, const std::string& mine) {
  std::vector<OtherEntry> out;
  std::error_code ec;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const fs::path& p = it->path();
    struct stat st {};
    if (p.filename() == mine || ::stat((p / "lock").c_str(), &st) != 0) continue;  // not an entry
    out.push_back(OtherEntry{p, disk_usage(p), static_cast<int64_t>(st.st_mtime)});
  }
  std::sort(out.begin(), out.end(), [](const OtherEntry& a, const OtherEntry& b) { return a.last_used < b.last_used; });
  return out;
}

// Removes an entry nobody holds; false when another mount holds it.
bool remove_entry(const OtherEntry& e) {
  UniqueFd lock(::open((e.dir / "lock").c_str(), O_RDWR | O_CLOEXEC));
  if (!lock.valid() || ::flock(lock.get(), LOCK_EX | LOCK_NB) != 0) return false;
  std::error_code ec;
  for (const char* f : {"map", "data", "meta", "meta.tmp", "lock"}) fs::remove(e.dir / f, ec);
  fs::remove(e.dir, ec);  // fails harmlessly if a new mount has just created files there
  return true;
}

}  // namespace

std::string DiskCache::entry_name(const std::string& url) {
  const std::string key = cache_key(url);
  std::string name;
  for (char c : key.substr(0, 120)) name += std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' ? c : '_';
  return fmt::format("{}-{:08x}", name, crc_of(std::as_bytes(std::span(key.data(), key.size()))));
}

Result<std::optional<ObjectIdentity>> DiskCache::kept_identity(const DiskCacheConfig& cfg, const std::string& url) {
  auto text = read_small((fs::path(cfg.dir) / entry_name(url) / "meta").string());
  if (!text) return text.status();
  if (!text->starts_with(kMetaHeader)) return std::optional<ObjectIdentity>();
  ObjectIdentity id;
  id.url = url;
  std::string_view rest = std::string_view(*text).substr(kMetaHeader.size());
  bool has_size = false;
  while (!rest.empty()) {
    const size_t nl = rest.find('\n');
    const std::string_view line = rest.substr(0, nl);
    rest = nl == std::string_view::npos ? std::string_view() : rest.substr(nl + 1);
    const size_t sp = line.find(' ');
    if (sp == std::string_view::npos) continue;
    const std::string_view key = line.substr(0, sp), value = line.substr(sp + 1);
    if (key == "size") has_size = std::from_chars(value.data(), value.data() + value.size(), id.size).ec == std::errc();
    if (key == "etag") id.etag = std::string(value);
    if (key == "last-modified") id.last_modified = std::string(value);
  }
  // The entry must be exactly what meta_text() makes of it (URL and block size too).
  if (!has_size || meta_text(id, cfg.block_size) != *text) return std::optional<ObjectIdentity>();
  return std::optional<ObjectIdentity>(std::move(id));
}

DiskCache::DiskCache(std::string path, const DiskCacheConfig& cfg, const ObjectIdentity& id, UniqueFd lock)
    : path_(std::move(path)), cfg_(cfg), object_size_(id.size), lock_fd_(std::move(lock)) {}

Result<std::unique_ptr<DiskCache>> DiskCache::open(const DiskCacheConfig& cfg, const ObjectIdentity& id) {
  const std::string key = cache_key(id.url);
  if (id.etag.empty() && id.last_modified.empty()) {
    log::warn("{}: the server sends neither ETag nor Last-Modified, so a changed object could not be told "
              "from the kept one: not using the cache in {}", key, cfg.dir);
    return std::unique_ptr<DiskCache>();
  }
  QCOWFS_TRY(make_dir(cfg.dir));
  const std::string path = (fs::path(cfg.dir) / entry_name(id.url)).string();
  QCOWFS_TRY(make_dir(path));
  auto lock = open_file(path + "/lock", O_RDWR | O_CREAT);
  if (!lock) return lock.status();
  if (::flock(lock->get(), LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK) return Status::from_errno(errno, path + "/lock");
    log::warn("{}: its cache entry {} is in use by another mount; this mount does not use the disk cache", key,
              path);
    return std::unique_ptr<DiskCache>();
  }
  (void)::futimens(lock->get(), nullptr);  // last used: now (the eviction order)
  std::unique_ptr<DiskCache> c(new DiskCache(path, cfg, id, std::move(*lock)));
  QCOWFS_TRY(c->load(id));
  log::info("{}: disk cache {}: {} KiB kept, up to {} MiB", key, path, c->kept_bytes_ >> 10, c->budget_ >> 20);
  c->worker_ = std::thread([p = c.get()] { p->run(); });
  return c;
}

DiskCache::~DiskCache() {
  stop();
  const DiskCacheStats s = stats();
  log::debug("disk cache {}: {} blocks read, {} stored, {} did not match their record", path_, s.hits, s.stored,
             s.bad);
}

// Opens data and map, empties the entry when it was filled from another
// identity, loads the valid records and sets the budget (evicting others).
Status DiskCache::load(const ObjectIdentity& id) {
  auto data = open_file(path_ + "/data", O_RDWR | O_CREAT);
  if (!data) return data.status();
  auto map = open_file(path_ + "/map", O_RDWR | O_CREAT);
  if (!map) return map.status();
  data_fd_ = std::move(*data);
  map_fd_ = std::move(*map);
  const std::string meta = meta_text(id, cfg_.block_size);
  identity_crc_ = crc_of(std::as_bytes(std::span(meta.data(), meta.size())));
  auto current = read_small(path_ + "/meta");
  if (!current) return current.status();
  if (*current != meta) QCOWFS_TRY(reset_entry(meta));

  const uint64_t bs = cfg_.block_size;
  const uint64_t blocks = (object_size_ + bs - 1) / bs;
  records_.assign(blocks, DiskCacheRecord{});
  struct stat st {};
  if (::fstat(map_fd_.get(), &st) != 0) return Status::from_errno(errno, path_ + "/map");
  const uint64_t on_disk = std::min<uint64_t>(static_cast<uint64_t>(st.st_size) / sizeof(DiskCacheRecord), blocks);
  QCOWFS_TRY(pread_full(map_fd_.get(), std::as_writable_bytes(std::span(records_.data(), on_disk)), 0,
                        path_ + "/map"));
  for (uint64_t i = 0; i < blocks; ++i) {
    DiskCacheRecord& r = records_[i];
    const uint64_t len = std::min(bs, object_size_ - i * bs);
    if (r.magic == kRecordMagic && r.identity == identity_crc_ && r.length == len) {
      kept_bytes_ += len;
    } else {
      r = DiskCacheRecord{};
    }
  }

  uint64_t others = 0;
  std::vector<OtherEntry> entries = other_entries(cfg_.dir, fs::path(path_).filename().string());
  for (const OtherEntry& e : entries) others += e.bytes;
  for (const OtherEntry& e : entries) {
    if (others + kept_bytes_ <= cfg_.dir_limit) break;
    if (remove_entry(e)) {
      others -= e.bytes;
      log::info("disk cache: removed {} ({} KiB) to stay within {} MiB", e.dir.string(), e.bytes >> 10,
                cfg_.dir_limit >> 20);
    }
  }
  budget_ = cfg_.dir_limit > others ? cfg_.dir_limit - others : 0;
  if (kept_bytes_ > budget_) {
    QCOWFS_TRY(reset_entry(meta));
    records_.assign(blocks, DiskCacheRecord{});
    kept_bytes_ = 0;
  }
  return Status::ok();
}

// Empties the entry and makes it the entry of meta: map first (synced), then
// data, then the new meta renamed into place.
Status DiskCache::reset_entry(const std::string& meta) {
  if (::ftruncate(map_fd_.get(), 0) != 0 || ::fdatasync(map_fd_.get()) != 0)
    return Status::from_errno(errno, path_ + "/map");
  if (::ftruncate(data_fd_.get(), 0) != 0) return Status::from_errno(errno, path_ + "/data");
  return replace_file(path_ + "/meta", meta);
}

bool DiskCache::has(uint64_t index) {
  return index < records_.size() && records_[index].magic == kRecordMagic;
}

BlockCache::Fetch DiskCache::wrap(BlockCache::Fetch inner) {
  inner_ = std::move(inner);
  return [this](uint64_t off, BlockCache::Buffers dst, std::function<void(Status)> done) {
    fetch(inner_, off, std::move(dst), std::move(done));
  };
}

bool DiskCache::whole_block(uint64_t off, size_t len) const {
  const uint64_t bs = cfg_.block_size;
  return off % bs == 0 && off < object_size_ && len == std::min(bs, object_size_ - off);
}

// Several adjacent buffers (one request for several blocks): fetched together
// when none of them is kept (each whole block kept after), else one by one.
void DiskCache::fetch(const BlockCache::Fetch& inner, uint64_t off, BlockCache::Buffers dst,
                      std::function<void(Status)> done) {
  if (dst.size() == 1) return fetch_one(inner, off, dst[0], std::move(done));
  bool any_kept = false;
  {
    std::lock_guard lk(mu_);
    uint64_t at = off;
    for (const auto& d : dst) {
      any_kept = any_kept || (!stopping_ && whole_block(at, d.size()) && has(at / cfg_.block_size));
      at += d.size();
    }
  }
  if (any_kept) {
    struct Join {
      std::mutex mu;
      size_t left;
      Status first_error;
      std::function<void(Status)> done;
    };
    auto join = std::make_shared<Join>();
    join->left = dst.size();
    join->done = std::move(done);
    uint64_t at = off;
    for (const auto& d : dst) {
      fetch_one(inner, at, d, [join](Status st) {
        bool last = false;
        {
          std::lock_guard lk(join->mu);
          if (!st && join->first_error) join->first_error = std::move(st);
          last = --join->left == 0;
        }
        if (last) join->done(std::move(join->first_error));
      });
      at += d.size();
    }
    return;
  }
  BlockCache::Buffers bufs = dst;
  inner(off, std::move(dst), [this, off, bufs = std::move(bufs), done = std::move(done)](Status st) {
    if (st) {
      uint64_t at = off;
      for (const auto& d : bufs) {
        if (whole_block(at, d.size())) keep(at / cfg_.block_size, d);
        at += d.size();
      }
    }
    done(std::move(st));
  });
}

void DiskCache::fetch_one(const BlockCache::Fetch& inner, uint64_t off, std::span<std::byte> dst,
                          std::function<void(Status)> done) {
  const uint64_t index = off / cfg_.block_size;
  const bool whole = whole_block(off, dst.size());
  {
    std::lock_guard lk(mu_);
    if (!stopping_ && whole && has(index)) {
      reads_.push_back(ReadJob{index, dst, std::move(done)});
      wake_.notify_one();
      return;
    }
  }
  inner(off, {dst}, [this, index, dst, whole, done = std::move(done)](Status st) {
    if (st && whole) keep(index, dst);
    done(std::move(st));
  });
}

// Queues a copy of a fetched block for the worker, within the budget.
void DiskCache::keep(uint64_t index, std::span<const std::byte> bytes) {
  std::lock_guard lk(mu_);
  if (stopping_ || has(index) || queued_bytes_ + bytes.size() > kMaxQueuedBytes) return;
  if (kept_bytes_ + queued_bytes_ + bytes.size() > budget_) {
    if (!full_logged_) log::info("disk cache {} is full ({} MiB): further blocks are not kept", path_, budget_ >> 20);
    full_logged_ = true;
    return;
  }
  stores_.push_back(StoreJob{index, std::vector<std::byte>(bytes.begin(), bytes.end())});
  queued_bytes_ += bytes.size();
  wake_.notify_one();
}

void DiskCache::run() {
  std::unique_lock lk(mu_);
  for (;;) {
    wake_.wait(lk, [this] { return !reads_.empty() || !stores_.empty() || stopping_; });
    if (!reads_.empty()) {
      ReadJob job = std::move(reads_.front());
      reads_.pop_front();
      lk.unlock();
      serve(job, inner_);
      lk.lock();
    } else if (!stores_.empty()) {
      std::vector<StoreJob> batch(std::make_move_iterator(stores_.begin()), std::make_move_iterator(stores_.end()));
      stores_.clear();
      lk.unlock();
      store_batch(std::move(batch));
      lk.lock();
    } else {
      return;  // stopping, nothing left
    }
  }
}

// A kept block: read and checked; on any mismatch forgotten and fetched.
void DiskCache::serve(ReadJob& job, const BlockCache::Fetch& inner) {
  DiskCacheRecord r;
  {
    std::lock_guard lk(mu_);
    r = records_[job.index];
  }
  const uint64_t off = job.index * cfg_.block_size;
  Status st = r.magic == kRecordMagic ? pread_full(data_fd_.get(), job.dst, off, path_ + "/data")
                                      : Status::error(ENOENT, "not kept");
  if (st && crc_of(job.dst) == r.crc) {
    {
      std::lock_guard lk(mu_);
      ++stats_.hits;
    }
    job.done(Status::ok());
    return;
  }
  {
    std::lock_guard lk(mu_);
    if (records_[job.index].magic == kRecordMagic) {
      kept_bytes_ -= records_[job.index].length;
      records_[job.index] = DiskCacheRecord{};
      ++stats_.bad;
    }
  }
  log::warn("disk cache {}: block {} does not match its record ({}); fetching it again", path_, job.index,
            st ? "checksum" : st.message());
  inner(off, {job.dst}, [this, index = job.index, dst = job.dst, done = std::move(job.done)](Status s) {
    if (s) keep(index, dst);
    done(std::move(s));
  });
}

// Writes the blocks, syncs them, then writes their records.
void DiskCache::store_batch(std::vector<StoreJob> batch) {
  uint64_t queued = 0;
  std::vector<const StoreJob*> written;
  for (const StoreJob& j : batch) {
    queued += j.bytes.size();
    Status st = pwrite_full(data_fd_.get(), j.bytes, j.index * cfg_.block_size, path_ + "/data");
    if (!st) {
      if (!write_failed_logged_) log::warn("disk cache: {}; blocks that fail so are not kept", st.to_string());
      write_failed_logged_ = true;
      continue;
    }
    written.push_back(&j);
  }
  if (!written.empty() && ::fdatasync(data_fd_.get()) != 0) {
    log::warn("disk cache: syncing {}/data: {}; the blocks are not kept", path_, std::strerror(errno));
    written.clear();
  }
  for (const StoreJob* j : written) {
    const DiskCacheRecord rec{kRecordMagic, identity_crc_, static_cast<uint32_t>(j->bytes.size()), crc_of(j->bytes)};
    Status st = pwrite_full(map_fd_.get(), std::as_bytes(std::span(&rec, 1)), j->index * sizeof rec, path_ + "/map");
    if (!st) continue;
    std::lock_guard lk(mu_);
    if (records_[j->index].magic != kRecordMagic) kept_bytes_ += rec.length;
    records_[j->index] = rec;
    ++stats_.stored;
  }
  std::lock_guard lk(mu_);
  queued_bytes_ -= queued;
}

void DiskCache::stop() {
  {
    std::lock_guard lk(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (worker_.joinable()) worker_.join();
}

DiskCacheStats DiskCache::stats() const {
  std::lock_guard lk(mu_);
  return stats_;
}

}  // namespace qcowfs::io
