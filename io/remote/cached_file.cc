#include "io/remote/cached_file.h"

#include "io/log.h"

namespace qcowfs::io {

CachedFile::CachedFile(std::string name, uint64_t size, std::unique_ptr<DiskCache> disk, BlockCacheConfig cfg)
    : name_(std::move(name)), size_(size), disk_(std::move(disk)) {
  BlockCache::Fetch missing = [this](uint64_t off, BlockCache::Buffers, std::function<void(Status)> done) {
    done(Status::errorf(EIO, "{}: the server was unreachable at mount and block at {} is not in the disk cache",
                        name_, off));
  };
  cache_ = std::make_unique<BlockCache>(size, cfg, disk_->wrap(std::move(missing)));
}

CachedFile::~CachedFile() {
  disk_->stop();  // its queued reads finish into cache_
  cache_.reset();
}

Result<std::unique_ptr<HostFile>> CachedFile::open(const std::string& name, const std::string& url,
                                                   const RemoteOptions& opts, const Status& unreachable) {
  const DiskCacheConfig cfg{opts.cache_dir, opts.cache_dir_size, opts.block_size};
  auto id = DiskCache::kept_identity(cfg, url);
  if (!id || !*id) return unreachable;
  auto disk = DiskCache::open(cfg, **id);
  if (!disk) return disk.status();
  if (!*disk) return unreachable.with_context("its disk cache entry is in use");
  log::warn("{}: {}; serving what {} kept of it (the object as of an earlier mount: {} bytes, ETag {}, "
            "Last-Modified {}); other reads fail with EIO",
            name, unreachable.message(), (*disk)->path(), (*id)->size, (*id)->etag.empty() ? "-" : (*id)->etag,
            (*id)->last_modified.empty() ? "-" : (*id)->last_modified);
  BlockCacheConfig bc{opts.block_size, opts.cache_size, 0};  // no readahead: nothing to fetch ahead
  return std::unique_ptr<HostFile>(new CachedFile(name, (*id)->size, std::move(*disk), bc));
}

Status CachedFile::read_only() const { return Status::errorf(EROFS, "{} is read-only", name_); }

Task<Result<size_t>> CachedFile::read(uint64_t off, std::span<std::byte> buf) {
  co_return co_await cache_->read(off, buf);
}

Task<Result<size_t>> CachedFile::readv(uint64_t off, std::span<const iovec> iov) {
  co_return co_await cache_->readv(off, iov);
}

Task<Status> CachedFile::write(uint64_t, std::span<const std::byte>) { co_return read_only(); }
Task<Status> CachedFile::writev(uint64_t, std::span<const iovec>) { co_return read_only(); }
Task<Status> CachedFile::discard(uint64_t, uint64_t) { co_return read_only(); }
Task<Status> CachedFile::write_zeroes(uint64_t, uint64_t) { co_return read_only(); }
Task<Status> CachedFile::truncate(uint64_t) { co_return read_only(); }

}  // namespace qcowfs::io
