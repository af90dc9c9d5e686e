// CachedFile: the read-only HostFile of an http(s) or s3 object whose server
// could not be reached at open, served from what remote-cache-dir= kept of it
// (io/remote/disk_cache.h): the object as of the mount that filled the cache
// entry, its identity taken from the entry. Blocks kept there read as they
// were fetched; every other read fails with EIO naming the URL (the server is
// not asked again until the next mount). Writes fail with EROFS.
//
// Thread-safety: as HostFile: all methods from any event-loop thread.
#pragma once

#include <algorithm>
#include <memory>
#include <string>

#include "io/host_file.h"
#include "io/remote/block_cache.h"
#include "io/remote/disk_cache.h"
#include "io/remote/remote_options.h"

namespace qcowfs::io {

class CachedFile final : public HostFile {
 public:
  // name: what the user named (path()); url: the URL fetched (the key of the
  // entry); unreachable: why opening it over the network failed, returned
  // (with a note) when nothing of it is kept.
  static Result<std::unique_ptr<HostFile>> open(const std::string& name, const std::string& url,
                                                const RemoteOptions& opts, const Status& unreachable);
  ~CachedFile() override;

  Task<Result<size_t>> read(uint64_t off, std::span<std::byte> buf) override;
  Task<Result<size_t>> readv(uint64_t off, std::span<const iovec> iov) override;
  Task<Status> write(uint64_t off, std::span<const std::byte> buf) override;
  Task<Status> writev(uint64_t off, std::span<const iovec> iov) override;
  Task<Status> flush() override { co_return Status::ok(); }
  Task<Status> discard(uint64_t off, uint64_t len) override;
  Task<Status> write_zeroes(uint64_t off, uint64_t len) override;
  Task<Status> truncate(uint64_t size) override;
  Task<Result<uint64_t>> seek_data(uint64_t off) override { co_return std::min(off, size_); }
  Task<Result<uint64_t>> seek_hole(uint64_t) override { co_return size_; }

  uint64_t size() const override { return size_; }
  uint64_t allocated_bytes() const override { return size_; }
  size_t mem_align() const override { return 4096; }
  size_t offset_align() const override { return 1; }
  bool is_block_device() const override { return false; }
  bool writable() const override { return false; }
  CacheMode cache_mode() const override { return CacheMode::writeback; }
  const std::string& path() const override { return name_; }

 private:
  CachedFile(std::string name, uint64_t size, std::unique_ptr<DiskCache> disk, BlockCacheConfig cfg);
  Status read_only() const;

  std::string name_;
  uint64_t size_;
  std::unique_ptr<DiskCache> disk_;
  std::unique_ptr<BlockCache> cache_;
};

}  // namespace qcowfs::io
