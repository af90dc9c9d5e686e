// HttpFile: the read-only HostFile for an image served over http:// or
// https://. Reads go through a BlockCache (io/remote/block_cache.h) whose
// blocks are ranged GETs of an HttpClient (io/remote/http_client.h), which
// pins the object's identity at open and fails reads of a changed object.
// The first block, fetched by that identity request, serves the cache's first
// fetches within it (so a mount's probe costs no second round trip).
// Writes, discards and truncates fail with EROFS; everything reads as data.
// Its identity, settings and counters are registered for the daemon's
// statistics (io/remote/remote_stats.h) while it is open.
//
// open_remote_file() is what open_host_file() calls for a URL.
// Thread-safety: as HostFile: all methods from any event-loop thread.
#pragma once

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "io/host_file.h"
#include "io/remote/block_cache.h"
#include "io/remote/disk_cache.h"
#include "io/remote/http_client.h"
#include "io/remote/remote_stats.h"

namespace qcowfs::io {

class HttpFile final : public HostFile {
 public:
  // name: what the user named (path()); url: the http(s) URL fetched (the
  // same, or an s3:// name's endpoint URL); opts: effective remote options.
  static Result<std::unique_ptr<HttpFile>> open(const std::string& name, const std::string& url,
                                                const RemoteOptions& opts);
  ~HttpFile() override;

  Task<Result<size_t>> read(uint64_t off, std::span<std::byte> buf) override;
  Task<Result<size_t>> readv(uint64_t off, std::span<const iovec> iov) override;
  Task<Status> write(uint64_t off, std::span<const std::byte> buf) override;
  Task<Status> writev(uint64_t off, std::span<const iovec> iov) override;
  Task<Status> flush() override;
  Task<Status> discard(uint64_t off, uint64_t len) override;
  Task<Status> write_zeroes(uint64_t off, uint64_t len) override;
  Task<Status> truncate(uint64_t size) override;
  Task<Result<uint64_t>> seek_data(uint64_t off) override;
  Task<Result<uint64_t>> seek_hole(uint64_t off) override;

  uint64_t size() const override { return client_->identity().size; }
  uint64_t allocated_bytes() const override { return size(); }
  size_t mem_align() const override { return 4096; }
  size_t offset_align() const override { return 1; }
  bool is_block_device() const override { return false; }
  bool writable() const override { return false; }
  CacheMode cache_mode() const override { return CacheMode::writeback; }
  const std::string& path() const override { return url_; }

  BlockCacheStats stats() const { return cache_->stats(); }
  // Identity, settings and counters (as remote_stats_snapshot() lists them).
  RemoteStatsSnapshot describe() const;

 private:
  HttpFile(std::string url, std::unique_ptr<HttpClient> client, BlockCacheConfig cfg, std::unique_ptr<DiskCache> disk,
           std::string protocol, std::string settings);
  Status read_only() const;
  // Fills dst (a fetch at off) from open()'s first block when it lies within it.
  bool take_from_first_block(uint64_t off, const BlockCache::Buffers& dst);

  std::string url_;
  std::unique_ptr<HttpClient> client_;
  std::unique_ptr<DiskCache> disk_;  // remote-cache-dir=; under cache_, stopped before client_ goes
  std::mutex first_block_mu_;
  std::vector<std::byte> first_block_;  // guarded by first_block_mu_; freed once the cache has it whole
  std::unique_ptr<BlockCache> cache_;
  const std::string protocol_;  // "http" or "s3"
  const std::string settings_;
  std::optional<RemoteStatsRegistration> registration_;  // reset first in the destructor
};

// Opens a URL (io::is_remote_location) as a HostFile: http(s) and s3 (SigV4
// signed GETs of the endpoint's URL) through HttpFile, nbd through NbdFile.
Result<std::unique_ptr<HostFile>> open_remote_file(const std::string& url, const OpenOptions& opts);

}  // namespace qcowfs::io
