// ViewAccess: who may use the raw view, as stat shows it: its owner, group and
// permission bits. They start from the image file (or uid=/gid=/umask=/fmask=/
// dmask=, the spelling other FUSE file systems use) and change only through
// chmod/chown on the view, for the life of the mount (the image file is never
// touched). Every other node derives its attributes from the view's current
// values: partitions and snapshots show the view's bits (without write bits
// when they are read-only), directories r-x for each class that may read the
// view. The kernel enforces them (the mount always has default_permissions).
//
// Thread-safety: the free functions are pure; a ViewAccess may be read and
// changed from any thread (one mutex guards its values).
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <mutex>
#include <optional>

namespace qcowfs::fuse {

// The access mount options: absent means "from the image file".
struct AccessOptions {
  std::optional<uid_t> uid;
  std::optional<gid_t> gid;
  std::optional<mode_t> fmask;  // files 0666 & ~fmask (umask= sets both masks)
  std::optional<mode_t> dmask;  // directories: further restricted by ~dmask
};

// The view's owner, group and permission bits (at most 0666: never
// executable, no set-id bits), before read-only mounts drop the write bits.
struct ViewAttrs {
  uid_t uid = 0;
  gid_t gid = 0;
  mode_t mode = 0644;
};

// The view's first attributes: the image file's owner, group and rw bits,
// replaced by the options that are given.
ViewAttrs initial_view_attrs(const struct stat& image, const AccessOptions& opts);

// An image node's permission bits: the view's, without write bits when the
// node is read-only.
mode_t file_permissions(mode_t view_mode, bool writable);

// A directory's permission bits: r-x for each class (user, group, other) that
// may read the view, never writable (nothing can be created), minus dmask.
mode_t directory_permissions(mode_t view_mode, mode_t dmask);

// chmod/chown of the view: allowed to the mounting user and to root.
bool may_change_access(uid_t caller, uid_t mounter);

// One requested change (absent fields stay as they are).
struct AccessChange {
  std::optional<mode_t> mode;
  std::optional<uid_t> uid;
  std::optional<gid_t> gid;
};

class ViewAccess {
 public:
  explicit ViewAccess(ViewAttrs initial) : attrs_(initial) {}
  ViewAccess(const ViewAccess&) = delete;
  ViewAccess& operator=(const ViewAccess&) = delete;

  ViewAttrs get() const;
  // Applies all fields at once (a reader sees all or none of them); the mode
  // is cut down to 0666.
  void change(const AccessChange& c);

 private:
  mutable std::mutex mu_;
  ViewAttrs attrs_;  // guarded by mu_
};

}  // namespace qcowfs::fuse
