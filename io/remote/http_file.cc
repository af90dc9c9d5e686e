#include "io/remote/http_file.h"

#include <algorithm>

#include "io/log.h"
#include "io/remote/cached_file.h"
#include "io/remote/nbd_file.h"
#include "io/remote/s3.h"

namespace qcowfs::io {
namespace {

constexpr uint64_t kSmallFetch = 4096;  // the granule of small random reads

}  // namespace

HttpFile::HttpFile(std::string url, std::unique_ptr<HttpClient> client, BlockCacheConfig cfg,
                   std::unique_ptr<DiskCache> disk, std::string protocol, std::string settings)
    : url_(std::move(url)),
      client_(std::move(client)),
      disk_(std::move(disk)),
      protocol_(std::move(protocol)),
      settings_(std::move(settings)) {
  HttpClient* c = client_.get();
  first_block_ = c->take_first_block();
  BlockCache::Fetch fetch = [this, c](uint64_t off, BlockCache::Buffers dst, std::function<void(Status)> done) {
    if (take_from_first_block(off, dst)) return done(Status::ok());
    c->get_range(off, std::move(dst), std::move(done));
  };
  if (disk_) fetch = disk_->wrap(std::move(fetch));
  cache_ = std::make_unique<BlockCache>(c->identity().size, cfg, std::move(fetch));
  registration_.emplace([this] { return describe(); });
}

HttpFile::~HttpFile() {
  registration_.reset();
  log::debug("{}", format_remote_counters(describe()));
  if (disk_) disk_->stop();  // serves its queued reads, writes the blocks it was given
  client_.reset();  // fails and finishes its transfers, which still reach cache_
  cache_.reset();
  disk_.reset();
}

bool HttpFile::take_from_first_block(uint64_t off, const BlockCache::Buffers& dst) {
  uint64_t len = 0;
  for (const auto& d : dst) len += d.size();
  std::lock_guard lk(first_block_mu_);
  if (off + len > first_block_.size()) return false;
  const std::byte* src = first_block_.data() + off;
  for (const auto& d : dst) {
    std::copy_n(src, d.size(), d.data());
    src += d.size();
  }
  // The whole block is now the cache's: it is fetched again only if evicted.
  if (off == 0 && len == first_block_.size()) std::vector<std::byte>().swap(first_block_);
  return true;
}

RemoteStatsSnapshot HttpFile::describe() const {
  RemoteStatsSnapshot s;
  const HttpIdentity& id = client_->identity();
  s.url = protocol_ == "s3" ? url_ : client_->printable_url();
  s.protocol = protocol_;
  s.size = id.size;
  s.etag = id.etag;
  s.last_modified = id.last_modified;
  s.settings = settings_;
  client_->counters().fill(s);
  s.requests_per_thread = client_->requests_per_thread();
  const BlockCacheStats cs = cache_->stats();
  s.cache_hits = cs.hits;
  s.cache_misses = cs.misses;
  s.readahead_blocks = cs.readahead;
  s.readahead_bytes = cs.readahead * cache_->config().block_size;
  return s;
}

Result<std::unique_ptr<HttpFile>> HttpFile::open(const std::string& name, const std::string& url,
                                                 const RemoteOptions& opts) {
  auto client = HttpClient::open(url, opts);
  if (!client) return client.status().with_context("opening the remote image");
  const bool s3 = name.starts_with("s3://");
  // Read-ahead blocks must fit in the cache beside what is being read.
  const uint64_t readahead = std::min(opts.readahead, opts.cache_size / 2);
  // A sequential stream's requests: the readahead shared by the connections.
  const uint64_t max_request = std::max(opts.block_size, readahead / opts.connections);
  // Small random reads fetch 4 KiB granules; with a disk cache, whole blocks (what it keeps).
  const uint64_t small_fetch = opts.cache_dir.empty() ? kSmallFetch : 0;
  std::string settings = fmt::format(
      "blocks of {} KiB, requests up to {} KiB, small reads in {} KiB, cache {} MiB, readahead up to {} KiB, "
      "timeout {} s, {} connections on {} network threads", opts.block_size / 1024, max_request / 1024,
      (small_fetch ? small_fetch : opts.block_size) / 1024, opts.cache_size >> 20, readahead / 1024,
      opts.timeout_ms / 1000, opts.connections, std::min(opts.network_threads, opts.connections));
  if (url.starts_with("https://"))
    settings += opts.ssl_verify ? fmt::format(", TLS verified{}", opts.ca_file.empty() ? "" : " with " + opts.ca_file)
                                : ", TLS NOT verified (sslverify=off)";
  if (!opts.headers.empty() && !s3) settings += fmt::format(", {} extra headers", opts.headers.size());
  if (s3) settings += fmt::format(", S3 {} region {}, keys from {}", (*client)->printable_url(), opts.s3_region,
                                  opts.aws_credential_source);
  BlockCacheConfig cfg{opts.block_size, opts.cache_size, readahead, max_request, small_fetch};
  std::unique_ptr<DiskCache> disk;
  if (!opts.cache_dir.empty()) {
    const HttpIdentity& id = (*client)->identity();
    auto d = DiskCache::open(DiskCacheConfig{opts.cache_dir, opts.cache_dir_size, opts.block_size},
                             ObjectIdentity{url, id.size, id.etag, id.last_modified});
    if (!d) return d.status().with_context("remote-cache-dir");
    disk = std::move(*d);
    settings += fmt::format(", disk cache in {} (up to {} MiB)", opts.cache_dir, opts.cache_dir_size >> 20);
  }
  std::unique_ptr<HttpFile> f(
      new HttpFile(name, std::move(*client), cfg, std::move(disk), s3 ? "s3" : "http", std::move(settings)));
  log::debug("{}", format_remote_identity(f->describe()));
  return f;
}

Status HttpFile::read_only() const {
  return Status::errorf(EROFS, "{} is read-only (images over HTTP are; put a local overlay on it)",
                        client_->printable_url());
}

Task<Result<size_t>> HttpFile::read(uint64_t off, std::span<std::byte> buf) {
  co_return co_await cache_->read(off, buf);
}

Task<Result<size_t>> HttpFile::readv(uint64_t off, std::span<const iovec> iov) {
  co_return co_await cache_->readv(off, iov);
}

Task<Status> HttpFile::write(uint64_t, std::span<const std::byte>) { co_return read_only(); }
Task<Status> HttpFile::writev(uint64_t, std::span<const iovec>) { co_return read_only(); }
Task<Status> HttpFile::flush() { co_return Status::ok(); }
Task<Status> HttpFile::discard(uint64_t, uint64_t) { co_return read_only(); }
Task<Status> HttpFile::write_zeroes(uint64_t, uint64_t) { co_return read_only(); }
Task<Status> HttpFile::truncate(uint64_t) { co_return read_only(); }

Task<Result<uint64_t>> HttpFile::seek_data(uint64_t off) { co_return std::min(off, size()); }
Task<Result<uint64_t>> HttpFile::seek_hole(uint64_t) { co_return size(); }


Result<std::unique_ptr<HostFile>> open_remote_file(const std::string& url, const OpenOptions& opts) {
  if (url.starts_with("http://") || url.starts_with("https://") || url.starts_with("s3://")) {
    if (opts.writable)
      return Status::errorf(EROFS, "{}: images over HTTP and S3 are read-only (put a local overlay on it: "
                                   "qcowfs create -f qcow2 -b URL -F FORMAT overlay.qcow2)", url.substr(0, url.find('?')));
    auto ro = effective_remote_options(opts.remote);
    if (!ro) return ro.status();
    std::string fetched = url;
    if (url.starts_with("s3://")) {
      auto u = s3_request_url(url, *ro);
      if (!u) return u.status();
      fetched = *u;
    }
    auto f = HttpFile::open(url, fetched, *ro);
    // Unreachable (EIO: no connection, timeouts, TLS): what the disk cache kept.
    if (!f && f.status().code() == EIO && !ro->cache_dir.empty())
      return CachedFile::open(url, fetched, *ro, f.status());
    if (!f) return f.status();
    return std::unique_ptr<HostFile>(std::move(*f));
  }
  auto f = NbdFile::open(url, opts);
  if (!f) return f.status();
  return std::unique_ptr<HostFile>(std::move(*f));
}

}  // namespace qcowfs::io
