// Filesystem: the FUSE low-level operations of a qcowfs mount. Each callback
// decodes its request, checks it against the InodeTable and the bounds rules
// (fuse/ranges.h), and either replies at once (metadata) or spawns a request
// Task on the calling EventLoop that awaits the BlockDriver and replies when
// the I/O completes. Every path ends in exactly one fuse_reply_*; the errno of
// an error reply comes from Status::code(). READ and WRITE also come through
// serve_direct(), which decodes them itself and replies through the
// EventLoop.
//
// The view's owner, group and mode (fuse/access.h) are the one piece of
// metadata that changes: chmod/chown on the view, by the mounting user or
// root, change them for the life of the mount; every node's attributes are
// derived from their current values.
//
// Thread-safety: callbacks run concurrently on every queue thread. The inode
// tree is immutable after construction; ImageFiles, drivers and the
// ViewAccess are thread-safe.
// The Filesystem must outlive the session (it is the session's userdata).
#pragma once

#include <cstddef>
#include <memory>
#include <span>

#include "fuse/access.h"
#include "fuse/inode_table.h"
#include "io/status.h"

struct fuse_lowlevel_ops;

namespace qcowfs::fuse {

class Filesystem {
 public:
  // initial: the view's first owner, group and mode, the dmask and mount
  // time; view: the main view's inode; mounter: the mounting user.
  Filesystem(InodeTable table, AttrContext initial, Ino view, uid_t mounter);
  Filesystem(const Filesystem&) = delete;
  Filesystem& operator=(const Filesystem&) = delete;

  static const fuse_lowlevel_ops& operations();
  // Serves a READ or WRITE message (a fuse_in_header, its arguments and a
  // WRITE's payload) as operations() would, without libfuse, and drops an
  // INTERRUPT: true when it did. Called on an EventLoop thread, whose
  // send_reply() answers (EventLoop::Config::serve_direct).
  bool serve_direct(std::span<std::byte> message) const;

  const InodeTable& table() const { return table_; }
  // The view's current access with the mount's constant parts.
  AttrContext attr_context() const;

  // chmod/chown of inode `ino` by `caller`: changes the view's access (or a
  // catalogue view's own, Node::own_access); EPERM for any other node (its
  // access follows a view) or any other caller.
  Status change_access(Ino ino, uid_t caller, const AccessChange& change);

 private:
  InodeTable table_;
  AttrContext ctx_;  // dir_mask and mount_time; its view is access_'s first value
  ViewAccess access_;
  const Ino view_;
  const uid_t mounter_;
};

}  // namespace qcowfs::fuse
