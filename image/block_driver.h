// BlockDriver: one opened disk image (raw, qcow2, a snapshot or a window onto a
// partition) seen as a flat array of guest bytes. fuse/ maps file operations on
// the mounted raw view onto these calls; qcow2 backing chains are BlockDrivers
// stacked on BlockDrivers.
//
// Contract: callers keep every request inside [0, size()) (fuse/ checks bounds
// and turns violations into errno replies). Buffers aligned to mem_align() avoid
// bounce copies. A failed request leaves the image consistent; its Status
// carries the errno for the reply (EIO, ENOSPC, EROFS, EINVAL).
//
// Thread-safety: every method may be called concurrently from any event-loop
// thread; the coroutine resumes on the calling thread's Engine.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "image/json.h"
#include "io/hold.h"
#include "io/host_file.h"
#include "io/status.h"
#include "io/task.h"

namespace qcowfs::image {

namespace crypto {
class KeyProvider;  // image/crypto/secret.h
}
class SharedImages;  // image/shared_images.h

// Allocation status of a range, as `qemu-img map` reports it. Every byte of
// the range has the same flags, depth and file, and host offsets that follow
// each other (byte i of the range is stored at host_offset + i).
struct BlockStatus {
  uint64_t length = 0;  // bytes from the queried offset with the same status (> 0)
  bool data = false;    // bytes are stored somewhere in the chain (not a hole)
  bool zero = false;    // bytes are known to read as zeros
  // The layer at `depth` records these bytes (data or zeros); false where
  // nothing in the chain does and they read as zeros (qemu's "present").
  bool present = false;
  int depth = 0;        // 0 = this image, 1 = its backing file, ...
  // Where the bytes live uncompressed in a host file (qemu's "offset"): the
  // file and the offset of the range's first byte. nullptr for compressed,
  // zero and unallocated ranges that name no host cluster. The file belongs to
  // the driver (or a driver below it) and lives as long as that driver.
  const io::HostFile* file = nullptr;
  uint64_t host_offset = 0;
};

// What `qemu-img info` shows of an image beyond its name, format and sizes
// (tools/info.cc prints it, with qemu-img's field names).
struct ImageDetails {
  uint64_t cluster_size = 0;   // "cluster-size"; 0: qemu-img shows none for the format
  std::string backing_file;    // as the image records it; "" for none
  std::string backing_format;  // as the image records it; "" for none
  std::optional<bool> dirty;   // "dirty-flag"; nullopt where qemu-img shows none
  bool encrypted = false;      // "encrypted": true (qemu-img prints "encrypted: yes")
  // "format-specific": {"type": format, "data": specific}; an empty object: none.
  Json specific = Json::object();
};

struct SnapshotInfo {
  std::string id;
  std::string name;
  uint64_t disk_size = 0;
  uint64_t vm_state_size = 0;
  uint64_t date_sec = 0;
  uint32_t date_nsec = 0;
  uint64_t vm_clock_ns = 0;
};

// A persistent dirty bitmap of an open image (qcow2's; QEMU's query-block
// "dirty-bitmaps" entry): what changed since the bitmap was made or cleared.
struct BitmapInfo {
  std::string name;
  uint64_t granularity = 0;  // bytes per bit
  bool enabled = false;      // writes through this driver set its bits (QEMU's "recording")
  // Found in use at open (whoever had the image open did not store it): not
  // loaded, and unusable, as QEMU's "inconsistent" bitmaps.
  bool inconsistent = false;
  uint64_t dirty_bytes = 0;  // disk bytes its dirty granules cover (QEMU's "count")
};

// A run of a bitmap's granules from an offset that are all dirty or all clean.
struct BitmapRun {
  uint64_t length = 0;  // bytes from the queried offset (> 0)
  bool dirty = false;
};

// A read that is nothing but one host read: guest bytes [off, off + len)
// are what file->read() gives at host_offset, with nothing left for the
// driver to do (no decompression, zero fill, backing read or filter; the
// file itself may decrypt, as qcow2's LUKS CryptFile), and stay so while the
// holds are kept. Bytes past the file's end read as zeros. The caller reads
// them with file->read() (or readv()) and drops the MappedRead once that has
// completed, which releases the holds: in the order they were added, the
// innermost driver's first (an outer layer's hold keeps the inner driver
// alive). BlockDriver::map_read() gives one.
class MappedRead {
 public:
  static constexpr size_t kMaxHolds = 3;

  MappedRead(io::HostFile* f, uint64_t at) : file(f), host_offset(at) {}
  MappedRead(MappedRead&& o) noexcept : file(o.file), host_offset(o.host_offset), count_(o.count_) {
    for (size_t i = 0; i < count_; ++i) holds_[i] = std::move(o.holds_[i]);
    o.count_ = 0;
  }
  MappedRead& operator=(MappedRead&& o) noexcept {
    if (this != &o) {
      release();
      file = o.file;
      host_offset = o.host_offset;
      for (size_t i = 0; i < o.count_; ++i) holds_[i] = std::move(o.holds_[i]);
      count_ = std::exchange(o.count_, 0);
    }
    return *this;
  }
  MappedRead(const MappedRead&) = delete;
  MappedRead& operator=(const MappedRead&) = delete;
  ~MappedRead() { release(); }
  // Whether keep() can take one more hold; a layer that finds it full drops
  // the run (releasing the inner holds) before releasing its own.
  bool full() const { return count_ == kMaxHolds; }
  // Keeps h until the run is dropped (!full()).
  void keep(io::Hold h) { holds_[count_++] = std::move(h); }

  io::HostFile* file;
  uint64_t host_offset;

 private:
  void release() {
    for (size_t i = 0; i < count_; ++i) holds_[i].release();
    count_ = 0;
  }

  std::array<io::Hold, kMaxHolds> holds_;
  size_t count_ = 0;
};

class BlockDriver {
 public:
  virtual ~BlockDriver() = default;
  BlockDriver() = default;
  BlockDriver(const BlockDriver&) = delete;
  BlockDriver& operator=(const BlockDriver&) = delete;

  virtual std::string_view format_name() const = 0;  // "raw", "qcow2"
  virtual uint64_t size() const = 0;                 // guest bytes
  virtual bool read_only() const = 0;
  virtual size_t mem_align() const = 0;

  virtual Task<Status> read(uint64_t off, std::span<std::byte> buf) = 0;
  // read()'s shortcut, never suspending: the one host run [off, off + len)
  // is where the driver knows that now (its mapping in memory, no lock it
  // would wait for; len > 0, inside the image), else nullopt and the caller
  // reads through read(). Reading the run gives what read() would. Default:
  // nullopt. Not forwarded by ForwardingDriver (a wrapper may change what
  // reads do: copy-on-read); wrappers that keep the bytes forward it.
  virtual std::optional<MappedRead> map_read(uint64_t /*off*/, uint64_t /*len*/) { return std::nullopt; }
  virtual Task<Status> write(uint64_t off, std::span<const std::byte> buf) = 0;
  // Makes all completed writes (data and metadata) durable per the cache mode.
  virtual Task<Status> flush() = 0;
  // The range may read back as anything afterwards (zeros where possible).
  virtual Task<Status> discard(uint64_t off, uint64_t len) = 0;
  // The range reads as zeros afterwards; may_unmap allows freeing host space.
  virtual Task<Status> write_zeroes(uint64_t off, uint64_t len, bool may_unmap) = 0;
  // Resizes the guest disk (EINVAL where the format cannot, e.g. shrinking over data).
  virtual Task<Status> truncate(uint64_t new_size) = 0;
  // Status of the range starting at off, up to len bytes (len > 0, off < size()).
  virtual Task<Result<BlockStatus>> block_status(uint64_t off, uint64_t len) = 0;
  // Host bytes used by the image (for st_blocks).
  virtual uint64_t allocated_bytes() const = 0;
  // Writes back everything dirty and releases host resources; idempotent. Must
  // be awaited before destruction on a writable image.
  virtual Task<Status> close() = 0;
  // Writes back dirty metadata without waiting for a flush; the fuse layer
  // calls it when the mount has been idle for a while. Default: nothing to do.
  virtual Task<Status> idle_writeback() { co_return Status::ok(); }
  // The host file that holds exactly this image's bytes at the same offsets
  // and nothing else (a raw image over a whole regular file), so the kernel
  // may read it without us (FUSE passthrough); nullptr for every other driver.
  virtual io::HostFile* identity_file() { return nullptr; }

  // What info shows of the image. Default: nothing beyond the size.
  virtual ImageDetails details() const { return {}; }

  // Internal snapshots (qcow2). open_snapshot() gives a read-only view of one
  // snapshot, found by id or name; it borrows this driver's files and must be
  // destroyed before this driver.
  virtual std::vector<SnapshotInfo> snapshots() const { return {}; }
  virtual Task<Result<std::unique_ptr<BlockDriver>>> open_snapshot(std::string id_or_name);

  // Persistent dirty bitmaps (qcow2's active image, read-write or read-only;
  // none for snapshot views and backing files). bitmap_run() answers from
  // the bits as they are now (a writable image's change with every write):
  // the run of bitmap `name` from off (< size()), up to len bytes (> 0);
  // ENOENT for no such bitmap, EINVAL for an inconsistent one.
  virtual std::vector<BitmapInfo> dirty_bitmaps() const { return {}; }
  virtual Result<BitmapRun> bitmap_run(std::string_view name, uint64_t off, uint64_t len) const;
};

// An open image handed to a format as its backing file (ImageOptions::backing).
struct GivenBacking {
  std::unique_ptr<BlockDriver> driver;
};

struct ImageOptions {
  std::string format;         // a registry name (image/format.h); "" probes
  io::OpenOptions file;       // access mode and cache mode for the image file
  bool discard_unmap = false; // discard=unmap: free host space on discard
  // compress=on: a writable qcow2 image stores whole clusters written into
  // unallocated space compressed (image/qcow2/DESIGN.md "Compressed writes");
  // other formats refuse it.
  bool compress_writes = false;
  std::string snapshot;       // open this internal snapshot (read-only)
  // Bytes of cache for the mapping tables (qcow2 and QED L2 tables, VHDX's
  // BAT); 0 = the format's default. Mount option l2_cache_size= (as qemu's
  // l2-cache-size) or its neutral alias table_cache_size=.
  uint64_t table_cache_size = 0;
  // Real paths of the images above this one in a backing chain, outermost
  // first. Set by the qcow2 driver when it opens a backing file; an image that
  // finds itself here is a loop and is refused.
  std::vector<std::string> backing_chain;
  // The overlay's path when this image is opened as its backing file (for
  // messages); "" for the image the user named.
  std::string backing_of;
  // Open the image alone, without its backing file (qemu-img info does:
  // unallocated ranges then read as zeros).
  bool no_backing = false;
  // An image already open to serve as this one's backing file instead of the
  // file its header names, if any (a throwaway overlay over the image the user
  // named: image/views/throwaway.h). qcow2 takes the driver out at open (the
  // other formats ignore it). Shared so that ImageOptions stays copyable.
  std::shared_ptr<GivenBacking> backing;
  // copy-on-read (QEMU's copy-on-read=on): reads of ranges the image does not
  // hold are written into it from its backing chain (image/copy_on_read.h).
  // For the image the user named only; refused on a read-only image.
  bool copy_on_read = false;
  // A remote backing file (a URL) that cannot be opened now does not fail its
  // overlay's open: it is opened when a read first needs it, and until then
  // such reads fail with EIO (image/backing.h). Set by mounts, for a local
  // overlay whose server is down; the tools open chains whole, as qemu-img.
  bool defer_remote_backing = false;
  // Where the passphrase of an encrypted image (LUKS, qcow2 encryption) comes
  // from; backing files use the same one. nullptr: the terminal's prompt
  // when there is one (crypto::KeyProvider::from_terminal), else ENOKEY.
  std::shared_ptr<crypto::KeyProvider> keys;
  // Backing files are opened through this registry, shared with every other
  // image that names the same file (image/shared_images.h); nullptr: each
  // overlay opens its own.
  std::shared_ptr<SharedImages> shared_backing;
};

// Opens path with the format given or probed. Backing files are opened
// read-only with their parent's recorded format.
Task<Result<std::unique_ptr<BlockDriver>>> open_image(std::string path, ImageOptions opts);

// open_image() on an already opened host file.
Task<Result<std::unique_ptr<BlockDriver>>> open_image_file(std::unique_ptr<io::HostFile> file, std::string path,
                                                           ImageOptions opts);

// The driver for file at path: `named` if given (format= or backing_fmt=),
// else probed (image/probe.h). Returns a registry name; a format qcowfs only
// recognises is refused with a message naming it (EMEDIUMTYPE), an unknown
// name with EINVAL. backing_of names the overlay when file is its backing file.
Task<Result<std::string>> choose_format(io::HostFile& file, const std::string& path, std::string_view named,
                                        std::string_view backing_of = {});

}  // namespace qcowfs::image
