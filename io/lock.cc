#include "io/lock.h"

#include <fcntl.h>

#include <cerrno>

#include "io/log.h"

namespace qcowfs::io {
namespace {

// Takes (F_RDLCK) or releases (F_UNLCK) one byte on an OFD. Returns 0 or -errno.
int set_byte(int fd, int64_t byte, short type) {
  struct flock fl = {};
  fl.l_whence = SEEK_SET;
  fl.l_start = byte;
  fl.l_len = 1;
  fl.l_type = type;
  return ::fcntl(fd, F_OFD_SETLK, &fl) == 0 ? 0 : -errno;
}

// Whether another open file description holds a lock on byte: the test QEMU
// makes (qemu_lock_fd_test with a write lock). Returns 1, 0 or -errno.
int byte_taken(int fd, int64_t byte) {
  struct flock fl = {};
  fl.l_whence = SEEK_SET;
  fl.l_start = byte;
  fl.l_len = 1;
  fl.l_type = F_WRLCK;
  if (::fcntl(fd, F_OFD_GETLK, &fl) != 0) return -errno;
  return fl.l_type == F_UNLCK ? 0 : 1;
}

// How to read an image whose writer refuses to share "write".
constexpr const char* kForceShareHint =
    " (a read-only mount with -o force-share, or qcowfs info, map and check with -U, can still read it)";

// errnos meaning "this host or file system cannot do OFD locks".
bool unsupported(int err) { return err == EINVAL || err == ENOLCK || err == EOPNOTSUPP || err == ENOSYS; }

Status take_bytes(int fd, const std::string& path, LockPerms p) {
  for (unsigned i = 0; i < kPermBits; ++i) {
    uint32_t bit = 1u << i;
    if (p.perms & bit) {
      if (int r = set_byte(fd, kLockPermBase + i, F_RDLCK); r < 0)
        return Status::from_errno(r, fmt::format("{}: taking the \"{}\" lock byte", path, perm_name(bit)));
    }
    if (!(p.shared & bit)) {
      if (int r = set_byte(fd, kLockSharedBase + i, F_RDLCK); r < 0)
        return Status::from_errno(r, fmt::format("{}: taking the shared \"{}\" lock byte", path, perm_name(bit)));
    }
  }
  return Status::ok();
}

// Same conditions and wording as QEMU's raw_check_lock_bytes.
Status check_conflicts(int fd, const std::string& path, LockPerms p) {
  for (unsigned i = 0; i < kPermBits; ++i) {
    uint32_t bit = 1u << i;
    if (p.perms & bit) {
      int r = byte_taken(fd, kLockSharedBase + i);
      if (r < 0) return Status::from_errno(r, fmt::format("{}: testing lock byte {}", path, kLockSharedBase + i));
      if (r > 0)
        return Status::errorf(EBUSY,
                              "{}: failed to get \"{}\" lock: another process (QEMU, qemu-img or qcowfs) is using "
                              "the image and does not allow it (use locking=off only if you know it is safe)",
                              path, perm_name(bit));
    }
    if (!(p.shared & bit)) {
      int r = byte_taken(fd, kLockPermBase + i);
      if (r < 0) return Status::from_errno(r, fmt::format("{}: testing lock byte {}", path, kLockPermBase + i));
      if (r > 0)
        return Status::errorf(EBUSY,
                              "{}: failed to get shared \"{}\" lock: another process (QEMU, qemu-img or qcowfs) "
                              "has the image open with \"{}\" permission{}",
                              path, perm_name(bit), perm_name(bit),
                              bit == kPermWrite ? kForceShareHint : "");
    }
  }
  return Status::ok();
}

}  // namespace

std::string_view to_string(LockMode m) {
  switch (m) {
    case LockMode::automatic: return "auto";
    case LockMode::on: return "on";
    case LockMode::off: return "off";
  }
  return "?";
}

Result<LockMode> parse_lock_mode(std::string_view s) {
  if (s == "auto") return LockMode::automatic;
  if (s == "on") return LockMode::on;
  if (s == "off") return LockMode::off;
  return Status::errorf(EINVAL, "invalid locking mode '{}' (use auto, on or off)", s);
}

std::string_view perm_name(uint32_t bit) {
  switch (bit) {
    case kPermConsistentRead: return "consistent read";
    case kPermWrite: return "write";
    case kPermWriteUnchanged: return "write unchanged";
    case kPermResize: return "resize";
  }
  return "unknown";
}

LockPerms LockPerms::for_image(bool writable, bool force_share) {
  LockPerms p;
  p.perms = kPermConsistentRead | (writable ? kPermWrite | kPermResize : 0);
  p.shared = force_share ? kPermAll : kPermConsistentRead | kPermWriteUnchanged;
  return p;
}

Result<ImageLock> ImageLock::acquire(const std::string& path, LockPerms p, LockMode mode) {
  if ((p.perms & ~kPermConsistentRead) && p.shared == kPermAll)
    return Status::errorf(EINVAL, "{}: force-share can only be used with read-only images", path);
  if (mode == LockMode::off) return ImageLock();
  // O_NONBLOCK: a FIFO named as an image must not hang the open.
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK));
  if (!fd.valid()) return Status::from_errno(errno, fmt::format("opening {} for locking", path));
  Status st = take_bytes(fd.get(), path, p);
  if (!st && unsupported(st.code())) {
    if (mode == LockMode::on)
      return Status::errorf(ENOTSUP, "{}: locking=on, but the host cannot take OFD locks on it ({})", path,
                            st.message());
    log::warn("{}: image locking unavailable here ({}); continuing without locks", path, st.message());
    return ImageLock();
  }
  QCOWFS_TRY(st);
  QCOWFS_TRY(check_conflicts(fd.get(), path, p));
  return ImageLock(std::move(fd));
}

Result<LockBytes> probe_lock_bytes(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY));
  if (!fd.valid()) return Status::from_errno(errno, fmt::format("opening {}", path));
  LockBytes out;
  for (unsigned i = 0; i < kPermBits; ++i) {
    int a = byte_taken(fd.get(), kLockPermBase + i);
    int b = byte_taken(fd.get(), kLockSharedBase + i);
    if (a < 0 || b < 0) return Status::from_errno(a < 0 ? a : b, fmt::format("testing lock bytes of {}", path));
    if (a) out.perms |= 1u << i;
    if (b) out.shared |= 1u << i;
  }
  return out;
}

}  // namespace qcowfs::io
