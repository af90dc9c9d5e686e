// HostFile: asynchronous access to one host file or block device, the only way
// image/ reaches the host. Implementations: PosixFile (regular files and block
// devices, through the calling thread's Engine, handling O_DIRECT alignment with
// bounce buffers) and MemFile (in memory, with fault injection, for tests).
//
// Offsets and lengths may be arbitrary; implementations make them legal for
// the host (read-modify-write for unaligned writes, serialised against
// overlapping requests). Buffers aligned to mem_align() and ranges aligned to
// offset_align() go straight to the host without copies.
//
// Thread-safety: all methods may be called concurrently from any event-loop
// thread (each thread has its own Engine). size() reflects completed writes
// and truncates.
#pragma once

#include <sys/uio.h>

#include <compare>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "io/lock.h"
#include "io/remote/remote_options.h"
#include "io/status.h"
#include "io/task.h"

namespace qcowfs::io {

enum class CacheMode {
  none,          // O_DIRECT; flush = fdatasync
  writethrough,  // O_DSYNC (page cache); flush = fdatasync
  writeback,     // page cache; flush = fdatasync
  unsafe,        // page cache; flush is a no-op
};

std::string_view to_string(CacheMode m);
Result<CacheMode> parse_cache_mode(std::string_view s);

struct OpenOptions {
  bool writable = false;
  // The cache mode asked for; nullopt: the default, writeback. A host that
  // refuses O_DIRECT is an error for cache=none (nothing falls back silently).
  std::optional<CacheMode> cache;
  CacheMode cache_mode() const { return cache.value_or(CacheMode::writeback); }
  // Image locking as QEMU does it (io/lock.h): locking=auto|on|off, and
  // force-share (read-only opens only) to coexist with a writer, like qemu-img -U.
  LockMode locking = LockMode::automatic;
  bool force_share = false;
  // How a URL (io::is_remote_location) is reached; unused for local files.
  RemoteOptions remote;
};

class HostFile {
 public:
  virtual ~HostFile() = default;
  HostFile() = default;
  HostFile(const HostFile&) = delete;
  HostFile& operator=(const HostFile&) = delete;

  // Reads up to buf.size() bytes at off. Returns the bytes read: fewer only at
  // end of file (the rest of buf is left untouched).
  virtual Task<Result<size_t>> read(uint64_t off, std::span<std::byte> buf) = 0;
  // Scatter read; same contract as read().
  virtual Task<Result<size_t>> readv(uint64_t off, std::span<const iovec> iov) = 0;
  // Writes all of buf at off (extending the file if needed) or fails.
  virtual Task<Status> write(uint64_t off, std::span<const std::byte> buf) = 0;
  virtual Task<Status> writev(uint64_t off, std::span<const iovec> iov) = 0;
  // Makes completed writes durable according to the cache mode (no-op for unsafe).
  virtual Task<Status> flush() = 0;
  // Deallocates [off, off+len): PUNCH_HOLE on files, BLKDISCARD on devices.
  // Reads of the range afterwards return zeros on files; unspecified on devices.
  virtual Task<Status> discard(uint64_t off, uint64_t len) = 0;
  // Makes [off, off+len) read as zeros (ZERO_RANGE/BLKZEROOUT, else writes zeros).
  virtual Task<Status> write_zeroes(uint64_t off, uint64_t len) = 0;
  // Changes the file size (regular files only; EINVAL on block devices).
  virtual Task<Status> truncate(uint64_t size) = 0;

  // lseek(SEEK_DATA) / lseek(SEEK_HOLE) from off: the next data (or hole)
  // offset at or after off; size() when there is none. Hosts that cannot tell
  // report everything as data (seek_data = off, seek_hole = size()).
  virtual Task<Result<uint64_t>> seek_data(uint64_t off) = 0;
  virtual Task<Result<uint64_t>> seek_hole(uint64_t off) = 0;

  virtual uint64_t size() const = 0;
  // Bytes the host really has allocated for the file (st_blocks * 512).
  virtual uint64_t allocated_bytes() const = 0;
  virtual size_t mem_align() const = 0;     // buffer alignment for zero-copy I/O (>= 4096)
  virtual size_t offset_align() const = 0;  // offset/length alignment the host needs (1 if none)
  virtual bool is_block_device() const = 0;
  virtual bool writable() const = 0;
  virtual CacheMode cache_mode() const = 0;
  virtual const std::string& path() const = 0;
  // The descriptor of the open host file, for handing the file itself to the
  // kernel (FUSE passthrough); -1 when there is none (in-memory files).
  virtual int kernel_fd() const { return -1; }
  // The largest alignment (of offsets, lengths and buffers) the host needs of
  // O_DIRECT transfers on this file, whatever the cache mode; 0 if unknown.
  virtual size_t direct_io_align() const { return 0; }

  // Keeps the image lock for as long as this file is open (open_host_file).
  void hold_lock(ImageLock lock) { lock_ = std::move(lock); }

 private:
  ImageLock lock_;
};

// Which host file a HostFile is: (st_dev, st_ino), to tell that two paths name
// one file. nullopt for files without a descriptor (in memory, URLs).
struct FileIdentity {
  uint64_t dev = 0;
  uint64_t ino = 0;
  auto operator<=>(const FileIdentity&) const = default;
};
std::optional<FileIdentity> file_identity(const HostFile& file);

// Opens a regular file or block device, or a URL (io/remote/http_file.h). Fails
// with a clear message naming path.
Result<std::unique_ptr<HostFile>> open_host_file(const std::string& path, const OpenOptions& opts);
// Creates the regular file path (mode 0644 less the umask) or empties the one
// already there, then opens it writable as open_host_file() does.
Result<std::unique_ptr<HostFile>> create_host_file(const std::string& path, OpenOptions opts);
// Creates an empty file in directory dir that has no name (O_TMPFILE; where
// the file system lacks it, a file unlinked right after it is made), opened
// read-write with cache=unsafe (flush does nothing) and no lock (nobody else
// can open it): its space is freed when it is closed, also when the process
// is killed.
Result<std::unique_ptr<HostFile>> create_unnamed_file(const std::string& dir);

}  // namespace qcowfs::io
