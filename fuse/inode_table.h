// InodeTable: the fixed tree of nodes a mount shows. Two layouts:
//   file mode       the root inode is the raw view itself (mounted over a
//                   regular file, as qemu-storage-daemon does);
//   directory mode  the root is a directory holding <name>.raw and, when the
//                   image has internal snapshots (or may get some: a live
//                   qcow2 mount), snapshots/<snapshot>.raw (snapshots_dir.h),
//                   when it has persistent dirty bitmaps, bitmaps/<bitmap>.raw.
// Later layouts (partitions) add directories and image nodes the same way:
// add_directory() / add_image() under any directory.
//
// The tree is built before the mount starts and never changes afterwards, so
// lookups need no locks; only the ImageFiles behind image nodes change state,
// and the DynamicDirectories (partitions/ and snapshots/, or a catalogue's
// directories) lock their own entries.
// Inode numbers are dense, starting at kRootIno (FUSE_ROOT_ID).
// Thread-safety: building is single-threaded; const methods are thread-safe.
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "fuse/access.h"
#include "fuse/image_file.h"

namespace qcowfs::fuse {

using Ino = uint64_t;
constexpr Ino kRootIno = 1;  // FUSE_ROOT_ID

enum class NodeKind { directory, image };

struct Node {
  Ino ino = 0;
  Ino parent = 0;
  NodeKind kind = NodeKind::directory;
  std::string name;
  std::vector<Ino> children;          // directories: in readdir order
  std::unique_ptr<ImageFile> file;    // image nodes
  // The node's own owner, group and mode (a catalogue's images: each image
  // file's); nullptr: the view's (AttrContext::view).
  std::shared_ptr<ViewAccess> access;
  // chmod/chown of this node change `access` (a catalogue's image views; the
  // nodes that share it follow).
  bool own_access = false;
};

// What every node's stat derives from: the view's current owner, group and
// permission bits (fuse/access.h), the dmask= of the mount, and when the mount
// started.
struct AttrContext {
  ViewAttrs view;
  mode_t dir_mask = 0;
  struct timespec mount_time = {};
};

// Directories whose entries change while mounted (partitions/, a catalogue's
// directories): they own their nodes and keep every node they ever handed out
// alive (a request may still be using one after a refresh dropped it) until
// they are destroyed. One object may serve several directories (a catalogue
// serves the root and every subdirectory it found): every call names the
// directory.
// Thread-safety: every method may be called concurrently.
class DynamicDirectory {
 public:
  virtual ~DynamicDirectory() = default;
  virtual bool has_directory(Ino dir) const = 0;
  virtual const Node* get(Ino ino) const = 0;  // nullptr: not one of its nodes
  virtual const Node* lookup(Ino dir, std::string_view name) const = 0;
  virtual std::vector<Ino> children(Ino dir) const = 0;  // the current entries, in order
  virtual std::vector<ImageFile*> image_files() const = 0;  // every node ever made
  // Re-reads the entries of dir (on opendir).
  virtual Task<Status> refresh(Ino dir) = 0;
  // Brings `name` in dir up to date before a lookup answers (called when
  // needs_refresh(dir)); by default the whole directory is re-read.
  virtual Task<Status> refresh_name(Ino dir, std::string name) {
    (void)name;
    co_return co_await refresh(dir);
  }
  // True when the entries of dir may be out of date: a lookup refreshes first.
  virtual bool needs_refresh(Ino dir) const {
    (void)dir;
    return false;
  }
  // What a refresh reads, for messages: "the partition table".
  virtual std::string_view source() const = 0;
};

class InodeTable {
 public:
  // Makes the root: a directory, or (file mode) the image node `root_file`.
  static InodeTable directory_root();
  static InodeTable file_root(std::unique_ptr<ImageFile> root_file);

  InodeTable(InodeTable&&) = default;
  InodeTable& operator=(InodeTable&&) = default;

  Ino add_directory(Ino parent, std::string name);
  Ino add_image(Ino parent, std::string name, std::unique_ptr<ImageFile> file);

  // Makes the directories `d` serves dynamic: their entries (and the nodes
  // they hold) come from `d` (added while building; their inode ranges must
  // not overlap).
  void set_dynamic(std::unique_ptr<DynamicDirectory> d) { dynamic_.push_back(std::move(d)); }
  // The dynamic directory behind ino, or nullptr.
  DynamicDirectory* dynamic_for(Ino ino) const {
    for (const auto& d : dynamic_)
      if (d->has_directory(ino)) return d.get();
    return nullptr;
  }
  // A directory's current children (a dynamic directory's included).
  std::vector<Ino> children(const Node& dir) const;

  const Node* get(Ino ino) const;
  const Node* lookup(Ino parent, std::string_view name) const;
  size_t node_count() const { return nodes_.size(); }
  bool root_is_file() const { return nodes_.front().kind == NodeKind::image; }

  // Every ImageFile in the tree, in inode order (for shutdown and statfs).
  std::vector<ImageFile*> image_files() const;

  // The attributes of a node: image files the view's mode (without write
  // bits when read-only), directories r-x where the view is readable (see
  // fuse/access.h), all owned as the view; st_blocks from the host allocation.
  struct stat attributes(const Node& node, const AttrContext& ctx) const;

 private:
  InodeTable() = default;
  Ino add(Ino parent, std::string name, NodeKind kind, std::unique_ptr<ImageFile> file);
  std::vector<Node> nodes_;  // nodes_[ino - kRootIno]
  std::vector<std::unique_ptr<DynamicDirectory>> dynamic_;
};

// DIR/<image basename without its format suffix (.qcow2, .vmdk, .luks, ...)>.raw
std::string raw_view_name(std::string_view image_path);

// A file name for a snapshot: "<name>.raw" when the name is usable as a file
// name and not taken already, else "snapshot-<id>.raw".
std::string snapshot_file_name(std::string_view name, std::string_view id,
                               const std::vector<std::string>& taken);

// DIR/bitmaps/: a read-only view (image/views/bitmap_view.h) of each
// consistent persistent dirty bitmap of driver, enabled or disabled, named
// "<bitmap>.raw" (or "bitmap-<n>.raw", n counting from 1 in the image's
// order, when the name is not usable as a file name). An inconsistent bitmap
// (in use at open) is left out with a warning, as qemu-nbd -B refuses it. No
// bitmap to show: no directory. driver must outlive the table's views.
void add_bitmap_directory(InodeTable& table, image::BlockDriver& driver);

}  // namespace qcowfs::fuse
