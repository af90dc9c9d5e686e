#include "fuse/passthrough.h"

#include <fuse_lowlevel.h>
#include <linux/capability.h>
#include <linux/fuse.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>

namespace qcowfs::fuse::passthrough {
namespace {

// The kernel's struct fuse_backing_map and ioctls (include/uapi/linux/fuse.h, 7.40).
struct BackingMap {
  int32_t fd;
  uint32_t flags;
  uint64_t padding;
};
static_assert(sizeof(BackingMap) == 16);
constexpr unsigned long kIocBackingOpen = _IOW(229, 1, BackingMap);
constexpr unsigned long kIocBackingClose = _IOW(229, 2, uint32_t);

// The kernel's struct fuse_open_out since 7.40: backing_id took the padding.
struct OpenOut {
  uint64_t fh;
  uint32_t open_flags;
  int32_t backing_id;
};
static_assert(sizeof(OpenOut) == sizeof(fuse_open_out));

constexpr uint32_t kOpenNoFlush = 1u << 5;  // FOPEN_NOFLUSH

}  // namespace

bool permitted() {
  __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[_LINUX_CAPABILITY_U32S_3] = {};
  if (::syscall(SYS_capget, &header, data) != 0) return false;
  return (data[CAP_TO_INDEX(CAP_SYS_ADMIN)].effective & CAP_TO_MASK(CAP_SYS_ADMIN)) != 0;
}

Result<Backing> Backing::open(int fuse_fd, int host_fd) {
  BackingMap map = {host_fd, 0, 0};
  int id = ::ioctl(fuse_fd, kIocBackingOpen, &map);
  if (id < 0) return Status::from_errno(errno, "registering the image for FUSE passthrough");
  return Backing(fuse_fd, id);
}

Backing::~Backing() {
  if (id_ < 0) return;
  uint32_t id = static_cast<uint32_t>(id_);
  (void)::ioctl(fuse_fd_, kIocBackingClose, &id);  // fails only once the connection is gone
}

void reply_open(fuse_req_t req, int32_t backing_id) {
  OpenOut out = {};
  out.open_flags = kOpenFlag | kOpenNoFlush;
  out.backing_id = backing_id;
  iovec iov = {&out, sizeof out};
  fuse_reply_iov(req, &iov, 1);
}

}  // namespace qcowfs::fuse::passthrough
