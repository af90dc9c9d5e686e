// RemoteOptions: how images named by URL (http://, https://, s3://, nbd://,
// nbd+unix://) are reached: the block size and cache of remote reads, the
// readahead, the timeout and retries, TLS verification and extra headers.
// Mount options (-o remote-timeout=10,sslverify=off, ...) fill one; the tools
// (info, map, check, create -b URL) take the same list from the environment
// variable QCOWFS_REMOTE_OPTIONS when no option was given explicitly.
// Thread-safety: plain values.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "io/status.h"

namespace qcowfs::io {

struct RemoteOptions {
  uint64_t block_size = 256 * 1024;        // remote-block-size=: bytes fetched per request
  uint64_t cache_size = 64 * 1024 * 1024;  // remote-cache-size=: LRU of fetched blocks
  uint64_t readahead = 16 * 1024 * 1024;   // remote-readahead=: most a sequential reader runs ahead (0: off)
  unsigned timeout_ms = 30000;             // remote-timeout= (seconds): a request fails with EIO after this
  unsigned connections = 8;                // remote-connections=: kept-alive connections (requests in flight)
  unsigned network_threads = 2;            // remote-threads=: network threads of http(s)/s3 (at most connections)
  // remote-cache-dir=: keep fetched blocks of http(s)/s3 objects in this
  // folder across mounts (io/remote/disk_cache.h); "" for none. Made absolute
  // when given. remote-cache-dir-size=: most bytes kept there, all objects.
  std::string cache_dir;
  uint64_t cache_dir_size = uint64_t{1} << 30;
  bool ssl_verify = true;                  // sslverify=on|off
  std::string ca_file;                     // cafile=: CA certificates to verify the server with
  std::vector<std::string> headers;        // header-file= (one "Name: value" a line), token-file= (a bearer token)
  // s3://bucket/key: s3-endpoint= (default AWS: https://s3.REGION.amazonaws.com),
  // s3-region= (default: AWS_REGION, AWS_DEFAULT_REGION, the profile's, us-east-1),
  // s3-addressing=path|virtual (default: path with an endpoint, virtual-hosted
  // without). Credentials as the AWS CLI finds them (io/remote/s3.h); requests
  // are signed with SigV4.
  std::string s3_endpoint;
  std::string s3_region;
  std::string s3_addressing;  // "", "path" or "virtual"
  bool set_by_user = false;                // any of the above given explicitly
  // Set when an s3:// name is opened (not options): curl's SigV4 provider
  // string and "KEY:SECRET".
  std::string aws_sigv4;
  std::string aws_userpwd;
  std::string aws_credential_source;  // where the keys came from, for messages
};

// Applies one KEY=VALUE option; false when key is not a remote option. Files
// named by header-file= and token-file= are read now (their content never
// comes from argv, and a daemon that changed directory still has it).
Result<bool> apply_remote_option(RemoteOptions& o, std::string_view key, std::string_view value);
// Applies a comma-separated KEY=VALUE list (the QCOWFS_REMOTE_OPTIONS syntax).
Status apply_remote_option_list(RemoteOptions& o, std::string_view list);
// o as given, or (when nothing was set explicitly) with QCOWFS_REMOTE_OPTIONS applied.
Result<RemoteOptions> effective_remote_options(const RemoteOptions& o);

// Whether name is a URL qcowfs opens remotely (http, https, s3, nbd, nbd+unix),
// rather than a local path.
bool is_remote_location(std::string_view name);
// Whether name begins with a URL scheme ("proto://"): such a name is never
// relative to another image's directory.
bool has_url_scheme(std::string_view name);

}  // namespace qcowfs::io
