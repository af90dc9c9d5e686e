// Filesystem: the FUSE low-level operations of a qcowfs mount. Each callback
// decodes its request, checks it against the InodeTable and the bounds rules
// (fuse/ranges.h), and either replies at once (metadata) or spawns a request
// Task on the calling EventLoop that awaits the BlockDriver and replies when
// the I/O completes. Every path ends in exactly one fuse_reply_*; the errno of
// an error reply comes from Status::code().
//
// Thread-safety: callbacks run concurrently on every queue thread. The inode
// tree is immutable after construction; ImageFiles and drivers are thread-safe.
// The Filesystem must outlive the session (it is the session's userdata).
#pragma once

#include <memory>

#include "fuse/inode_table.h"

struct fuse_lowlevel_ops;

namespace qcowfs::fuse {

class Filesystem {
 public:
  Filesystem(InodeTable table, AttrContext ctx);
  Filesystem(const Filesystem&) = delete;
  Filesystem& operator=(const Filesystem&) = delete;

  static const fuse_lowlevel_ops& operations();

  const InodeTable& table() const { return table_; }
  const AttrContext& attr_context() const { return ctx_; }

 private:
  InodeTable table_;
  AttrContext ctx_;
};

}  // namespace qcowfs::fuse
