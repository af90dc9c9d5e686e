#include "fuse/access.h"

namespace qcowfs::fuse {
namespace {

constexpr mode_t kFileBits = 0666;
constexpr mode_t kReadBits = 0444;

}  // namespace

ViewAttrs initial_view_attrs(const struct stat& image, const AccessOptions& opts) {
  ViewAttrs a;
  a.uid = opts.uid.value_or(image.st_uid);
  a.gid = opts.gid.value_or(image.st_gid);
  a.mode = opts.fmask ? (kFileBits & ~*opts.fmask) : (image.st_mode & kFileBits);
  return a;
}

mode_t file_permissions(mode_t view_mode, bool writable) {
  return view_mode & (writable ? kFileBits : kReadBits);
}

mode_t directory_permissions(mode_t view_mode, mode_t dmask) {
  mode_t bits = 0;
  for (mode_t shift : {6u, 3u, 0u})
    if (view_mode & (mode_t{S_IROTH} << shift)) bits |= mode_t{S_IROTH | S_IXOTH} << shift;
  return bits & ~dmask;
}

bool may_change_access(uid_t caller, uid_t mounter) { return caller == 0 || caller == mounter; }

ViewAttrs ViewAccess::get() const {
  std::lock_guard lk(mu_);
  return attrs_;
}

void ViewAccess::change(const AccessChange& c) {
  std::lock_guard lk(mu_);
  if (c.mode) attrs_.mode = *c.mode & kFileBits;
  if (c.uid) attrs_.uid = *c.uid;
  if (c.gid) attrs_.gid = *c.gid;
}

}  // namespace qcowfs::fuse
