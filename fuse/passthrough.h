// Passthrough: FUSE passthrough (Linux 6.9+), where the kernel serves an open
// file's reads and writes from a host file itself, without a request to the
// daemon. qcowfs uses it for read-only mounts of a raw image over a regular
// file, whose bytes are the image's bytes at the same offsets. libfuse 3.14
// predates the feature, so its kernel ABI is spelled out here: the INIT flag,
// the open flag and the backing-file ioctls on /dev/fuse.
//
// Which views pass through is decided in ImageFile::passthrough_file(): only
// read-only mounts (writes past the end must fail as on a fixed-size disk, and
// the daemon must see every write), since the kernel cannot mix passed-through
// and ordinary opens of one file.
//
// Thread-safety: Backing is immutable once registered; reply_open() may be
// called from any loop thread.
#pragma once

#include <cstdint>

#include "io/status.h"

struct fuse_req;
typedef struct fuse_req* fuse_req_t;

namespace qcowfs::fuse::passthrough {

// FUSE_PASSTHROUGH is bit 37 of the INIT flags: bit 5 of flags2.
constexpr uint32_t kInitFlag2 = 1u << 5;
// How deep the backing file's filesystem may itself be stacked: not at all.
constexpr uint32_t kMaxStackDepth = 1;
// FOPEN_PASSTHROUGH in the OPEN reply's open_flags.
constexpr uint32_t kOpenFlag = 1u << 7;
// A view passes through only if the host's O_DIRECT alignment is at most this.
constexpr size_t kMaxDirectAlign = 512;

// Whether this process may register backing files (CAP_SYS_ADMIN).
bool permitted();

// A host file registered with the FUSE connection (FUSE_DEV_IOC_BACKING_OPEN)
// and unregistered on destruction. The kernel keeps its own reference while
// files opened through it are open.
class Backing {
 public:
  static Result<Backing> open(int fuse_fd, int host_fd);
  Backing(Backing&& o) noexcept : fuse_fd_(o.fuse_fd_), id_(o.id_) { o.id_ = -1; }
  Backing& operator=(Backing&&) = delete;
  Backing(const Backing&) = delete;
  ~Backing();
  int32_t id() const { return id_; }

 private:
  Backing(int fuse_fd, int32_t id) : fuse_fd_(fuse_fd), id_(id) {}
  int fuse_fd_;
  int32_t id_;
};

// Replies to an OPEN of a read-only view so that the kernel serves the file
// from backing `id` (FOPEN_NOFLUSH: there is nothing to flush).
void reply_open(fuse_req_t req, int32_t backing_id);

}  // namespace qcowfs::fuse::passthrough
