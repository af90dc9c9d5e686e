// ImageLock: image locking compatible with QEMU's file-posix driver, so that a
// read-write qcowfs mount and qemu-img / a running QEMU refuse each other
// while read-only users share an image.
//
// QEMU's scheme (block/file-posix.c, raw_apply_lock_bytes/raw_check_lock_bytes):
// every user of a file takes open-file-description (OFD) read locks on single
// bytes: byte kLockPermBase + i for each permission bit i it holds, and byte
// kLockSharedBase + i for each permission bit i it does NOT let others hold.
// After taking its bytes, a user checks with F_OFD_GETLK (as if for a write
// lock, which any other holder's read lock blocks) that nobody refuses a
// permission it holds (byte 200 + i) and nobody holds a permission it refuses
// (byte 100 + i). The locks live on a private descriptor of the file and go
// away when it is closed (ImageLock's destructor), or when the process dies.
//
// Thread-safety: acquire() is a plain function; an ImageLock is a move-only
// value owned by one HostFile.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "io/fd.h"
#include "io/status.h"

namespace qcowfs::io {

// Permission bits: QEMU's BLK_PERM_* (include/block/block-common.h, QEMU >= 7.1).
inline constexpr uint32_t kPermConsistentRead = 0x01;
inline constexpr uint32_t kPermWrite = 0x02;
inline constexpr uint32_t kPermWriteUnchanged = 0x04;
inline constexpr uint32_t kPermResize = 0x08;
inline constexpr uint32_t kPermAll = 0x0f;
inline constexpr unsigned kPermBits = 4;
inline constexpr int64_t kLockPermBase = 100;    // RAW_LOCK_PERM_BASE
inline constexpr int64_t kLockSharedBase = 200;  // RAW_LOCK_SHARED_BASE

// QEMU's locking=auto|on|off: auto locks when the host supports OFD locks and
// quietly does not otherwise; on makes missing support an error.
enum class LockMode { automatic, on, off };

std::string_view to_string(LockMode m);
Result<LockMode> parse_lock_mode(std::string_view s);

// Name of one permission bit as QEMU prints it ("consistent read", "write", ...).
std::string_view perm_name(uint32_t bit);

// What one user of a file holds and what it lets others hold.
struct LockPerms {
  uint32_t perms = kPermConsistentRead;
  uint32_t shared = kPermAll;

  // What QEMU takes on the file under a qcow2 or raw image (and under each
  // backing file): readers hold consistent-read, writers also write and
  // resize; neither lets others write or resize. force_share (read-only
  // only) lets others do anything, like `qemu-img -U`.
  static LockPerms for_image(bool writable, bool force_share);
};

class ImageLock {
 public:
  ImageLock() = default;  // holds nothing
  ImageLock(ImageLock&&) noexcept = default;
  ImageLock& operator=(ImageLock&&) noexcept = default;

  // Opens path privately, takes the lock bytes for p and checks for
  // conflicts. EBUSY naming the permission when another user conflicts;
  // ENOTSUP when mode is on and the host has no OFD locks. mode off, or auto
  // without OFD support, returns an ImageLock that holds nothing.
  static Result<ImageLock> acquire(const std::string& path, LockPerms p, LockMode mode);

  bool held() const { return fd_.valid(); }

 private:
  explicit ImageLock(UniqueFd fd) : fd_(std::move(fd)) {}
  UniqueFd fd_;
};

// Lock bytes another process holds on path (F_OFD_GETLK probes from a private
// descriptor): bit i of .perms set when byte 100 + i is locked, of .shared
// when byte 200 + i is. For tests and diagnostics.
struct LockBytes {
  uint32_t perms = 0;
  uint32_t shared = 0;
};
Result<LockBytes> probe_lock_bytes(const std::string& path);

}  // namespace qcowfs::io
