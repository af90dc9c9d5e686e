// DiskCache: the on-disk cache of a remote object's blocks (-o
// remote-cache-dir=DIR), kept across mounts. It sits under the in-memory
// BlockCache as a wrapper of its Fetch: a block kept here is read from the
// disk, any other is fetched from the server and then kept. A request of
// several adjacent blocks goes to the server as one when none of them is kept
// (each whole block kept after), else block by block.
//
// Layout: one entry per object in DIR/<name>/ (name: the URL without query,
// user info or fragment, made a file name, and its CRC-32): `meta` (the URL,
// size, ETag, Last-Modified and block size the entry was filled from), `data`
// (sparse: block i at i * block size), `map` (one 16-byte record a block:
// magic, CRC-32 of the identity, length, CRC-32 of the bytes) and `lock`.
//
// Identity: the entry is used only for the same URL, size, ETag and
// Last-Modified (pinned at open by the HttpClient) and block size; any change
// empties it first. An object with neither ETag nor Last-Modified is not
// cached (its changes could not be seen).
//
// Crash safety: a block's bytes are written and fdatasync'ed before its map
// record is written, so a record never names bytes that did not reach the
// disk; records are not synced (a lost record is a block fetched again). A
// record counts only with this identity's CRC, and every read from the cache
// checks the bytes' CRC-32 (zlib) against the record and fetches the block
// from the server instead on a mismatch. Emptying an entry truncates map and
// data before the new meta is renamed into place.
//
// Sharing: the entry is locked (flock) for the mount's lifetime; a second
// mount of the same object at the same time runs without the disk cache and
// says so. Bound: at open, entries of other objects that nobody holds are
// removed, least recently opened first, until everything fits in the limit;
// what is left of the limit is this entry's, and blocks past it are not kept.
//
// Thread-safety: the wrapped Fetch may be called from any thread; one worker
// thread does the disk I/O (reads first, stores in batches). stop() serves
// the queued reads and writes the queued blocks, then turns the wrapper into
// a plain pass-through; the destructor stops.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "io/fd.h"
#include "io/remote/block_cache.h"
#include "io/status.h"

namespace qcowfs::io {

struct DiskCacheConfig {
  std::string dir;                       // remote-cache-dir=
  uint64_t dir_limit = uint64_t{1} << 30;  // remote-cache-dir-size=: all entries together
  uint64_t block_size = 256 * 1024;      // the BlockCache's block size
};

struct ObjectIdentity {
  std::string url;  // as fetched; its query, fragment and user info are not kept
  uint64_t size = 0;
  std::string etag;
  std::string last_modified;
};

struct DiskCacheStats {
  uint64_t hits = 0;      // blocks read from the disk
  uint64_t stored = 0;    // blocks written to the disk
  uint64_t bad = 0;       // blocks whose bytes did not match their record
};

// One record of the map file (little-endian on disk as in memory: the cache
// is private to this host).
struct DiskCacheRecord {
  uint32_t magic = 0;     // kMagic when written
  uint32_t identity = 0;  // CRC-32 of the entry's meta text
  uint32_t length = 0;    // the block's bytes
  uint32_t crc = 0;       // CRC-32 of them
};
static_assert(sizeof(DiskCacheRecord) == 16);

class DiskCache {
 public:
  // The entry of id in cfg.dir, locked for this process. nullptr (with a log
  // line saying why) when the object cannot be cached or another mount holds
  // the entry; an error only for a directory that cannot be used at all.
  static Result<std::unique_ptr<DiskCache>> open(const DiskCacheConfig& cfg, const ObjectIdentity& id);
  // The identity the entry of url in cfg.dir was filled from (for a mount
  // whose server is unreachable: io/remote/cached_file.h); nullopt when there
  // is no entry for url with cfg.block_size.
  static Result<std::optional<ObjectIdentity>> kept_identity(const DiskCacheConfig& cfg, const std::string& url);
  ~DiskCache();
  DiskCache(const DiskCache&) = delete;
  DiskCache& operator=(const DiskCache&) = delete;

  // inner, reading blocks kept here instead and keeping what inner fetches.
  // The DiskCache must outlive the returned function's calls (stop() first).
  BlockCache::Fetch wrap(BlockCache::Fetch inner);
  void stop();
  DiskCacheStats stats() const;
  // The entry's folder (for logs and tests).
  const std::string& path() const { return path_; }

  // The entry folder's name for a URL (exposed for tests).
  static std::string entry_name(const std::string& url);

 private:
  struct ReadJob {
    uint64_t index;
    std::span<std::byte> dst;
    std::function<void(Status)> done;
  };
  struct StoreJob {
    uint64_t index;
    std::vector<std::byte> bytes;
  };

  DiskCache(std::string path, const DiskCacheConfig& cfg, const ObjectIdentity& id, UniqueFd lock);
  Status load(const ObjectIdentity& id);
  Status reset_entry(const std::string& meta);
  // Whether block index is kept here (its record is valid).
  bool has(uint64_t index);
  void fetch(const BlockCache::Fetch& inner, uint64_t off, BlockCache::Buffers dst, std::function<void(Status)> done);
  void fetch_one(const BlockCache::Fetch& inner, uint64_t off, std::span<std::byte> dst,
                 std::function<void(Status)> done);
  bool whole_block(uint64_t off, size_t len) const;
  void keep(uint64_t index, std::span<const std::byte> bytes);
  void run();
  void serve(ReadJob& job, const BlockCache::Fetch& inner);
  void store_batch(std::vector<StoreJob> batch);

  const std::string path_;
  const DiskCacheConfig cfg_;
  const uint64_t object_size_;
  uint32_t identity_crc_ = 0;
  UniqueFd lock_fd_;
  UniqueFd data_fd_;
  UniqueFd map_fd_;
  BlockCache::Fetch inner_;  // set by wrap(), before any job
  bool write_failed_logged_ = false;  // the worker's

  mutable std::mutex mu_;  // guards everything below
  std::condition_variable wake_;
  std::vector<DiskCacheRecord> records_;
  uint64_t kept_bytes_ = 0;   // bytes of valid records
  uint64_t budget_ = 0;       // most bytes this entry may keep
  uint64_t queued_bytes_ = 0; // bytes of store jobs waiting
  std::deque<ReadJob> reads_;
  std::deque<StoreJob> stores_;
  bool stopping_ = false;
  bool full_logged_ = false;
  DiskCacheStats stats_;
  std::thread worker_;
};

}  // namespace qcowfs::io
