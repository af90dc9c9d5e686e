#include "io/remote/http_file.h"

#include <cstdlib>

#include "io/log.h"
#include "io/remote/cached_file.h"
#include "io/remote/nbd_file.h"

namespace qcowfs::io {

HttpFile::HttpFile(std::string url, std::unique_ptr<HttpClient> client, BlockCacheConfig cfg,
                   std::unique_ptr<DiskCache> disk)
    : url_(std::move(url)), client_(std::move(client)), disk_(std::move(disk)) {
  HttpClient* c = client_.get();
  BlockCache::Fetch fetch = [c](uint64_t off, std::span<std::byte> dst, std::function<void(Status)> done) {
    c->get_range(off, dst, std::move(done));
  };
  if (disk_) fetch = disk_->wrap(std::move(fetch));
  cache_ = std::make_unique<BlockCache>(c->identity().size, cfg, std::move(fetch));
}

HttpFile::~HttpFile() {
  const BlockCacheStats s = cache_->stats();
  log::debug("{}: {} block hits, {} misses, {} read ahead, {} bytes fetched, {} failed fetches, {} retries",
             client_->display_url(), s.hits, s.misses, s.readahead, s.bytes_fetched, s.failures, client_->retries());
  if (disk_) disk_->stop();  // serves its queued reads, writes the blocks it was given
  client_.reset();  // fails and finishes its transfers, which still reach cache_
  cache_.reset();
  disk_.reset();
}

Result<std::unique_ptr<HttpFile>> HttpFile::open(const std::string& name, const std::string& url,
                                                 const RemoteOptions& opts) {
  const RemoteOptions* ro = &opts;
  auto client = HttpClient::open(url, *ro);
  if (!client) return client.status().with_context("opening the remote image");
  const HttpIdentity& id = (*client)->identity();
  log::info("{}: {} bytes, ETag {}, Last-Modified {}; blocks of {} KiB, cache {} MiB, readahead up to {} KiB, "
            "timeout {} s, {} connections",
            (*client)->display_url(), id.size, id.etag.empty() ? "-" : id.etag,
            id.last_modified.empty() ? "-" : id.last_modified, ro->block_size / 1024, ro->cache_size >> 20,
            ro->readahead / 1024, ro->timeout_ms / 1000, ro->connections);
  BlockCacheConfig cfg{ro->block_size, ro->cache_size, ro->readahead};
  std::unique_ptr<DiskCache> disk;
  if (!ro->cache_dir.empty()) {
    auto d = DiskCache::open(DiskCacheConfig{ro->cache_dir, ro->cache_dir_size, ro->block_size},
                             ObjectIdentity{url, id.size, id.etag, id.last_modified});
    if (!d) return d.status().with_context("remote-cache-dir");
    disk = std::move(*d);
  }
  return std::unique_ptr<HttpFile>(new HttpFile(name, std::move(*client), cfg, std::move(disk)));
}

Status HttpFile::read_only() const {
  return Status::errorf(EROFS, "{} is read-only (images over HTTP are; put a local overlay on it)",
                        client_->display_url());
}

Task<Result<size_t>> HttpFile::read(uint64_t off, std::span<std::byte> buf) {
  co_return co_await cache_->read(off, buf);
}

Task<Result<size_t>> HttpFile::readv(uint64_t off, std::span<const iovec> iov) {
  size_t total = 0;
  for (const iovec& v : iov) {
    auto n = co_await cache_->read(off + total, std::span(static_cast<std::byte*>(v.iov_base), v.iov_len));
    if (!n) co_return n.status();
    total += *n;
    if (*n < v.iov_len) break;
  }
  co_return total;
}

Task<Status> HttpFile::write(uint64_t, std::span<const std::byte>) { co_return read_only(); }
Task<Status> HttpFile::writev(uint64_t, std::span<const iovec>) { co_return read_only(); }
Task<Status> HttpFile::flush() { co_return Status::ok(); }
Task<Status> HttpFile::discard(uint64_t, uint64_t) { co_return read_only(); }
Task<Status> HttpFile::write_zeroes(uint64_t, uint64_t) { co_return read_only(); }
Task<Status> HttpFile::truncate(uint64_t) { co_return read_only(); }

Task<Result<uint64_t>> HttpFile::seek_data(uint64_t off) { co_return std::min(off, size()); }
Task<Result<uint64_t>> HttpFile::seek_hole(uint64_t) { co_return size(); }

namespace {

// s3://bucket/key as the endpoint's https URL, with SigV4 signing set in ro.
Result<std::string> s3_request_url(const std::string& name, RemoteOptions& ro) {
  const std::string_view rest = std::string_view(name).substr(5);
  const size_t slash = rest.find('/');
  if (slash == 0 || slash == std::string_view::npos || slash + 1 == rest.size())
    return Status::errorf(EINVAL, "{}: an S3 location is s3://BUCKET/KEY", name);
  const std::string bucket(rest.substr(0, slash)), key(rest.substr(slash + 1));
  const char* id = std::getenv("AWS_ACCESS_KEY_ID");
  const char* secret = std::getenv("AWS_SECRET_ACCESS_KEY");
  if (!id || !*id || !secret || !*secret)
    return Status::errorf(EACCES, "{}: no S3 credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)", name);
  ro.aws_sigv4 = fmt::format("aws:amz:{}:s3", ro.s3_region);
  ro.aws_userpwd = fmt::format("{}:{}", id, secret);
  ro.headers.push_back("x-amz-content-sha256: UNSIGNED-PAYLOAD");
  if (const char* token = std::getenv("AWS_SESSION_TOKEN"); token && *token)
    ro.headers.push_back(fmt::format("x-amz-security-token: {}", token));
  const std::string endpoint =
      ro.s3_endpoint.empty() ? fmt::format("https://s3.{}.amazonaws.com", ro.s3_region) : ro.s3_endpoint;
  const bool virtual_hosted = ro.s3_addressing.empty() ? ro.s3_endpoint.empty() : ro.s3_addressing == "virtual";
  if (!virtual_hosted) return fmt::format("{}/{}/{}", endpoint, bucket, key);
  const size_t host = endpoint.find("://") + 3;
  return fmt::format("{}{}.{}/{}", endpoint.substr(0, host), bucket, endpoint.substr(host), key);
}

}  // namespace

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
