// Catalogue: the tree of a catalogue mount, `qcowfs SRCDIR MOUNTDIR`: one
// daemon serving every image of a directory of images.
//
//   MOUNTDIR/<name>.raw      the raw view of SRCDIR/<name>.<suffix>, for every
//                            file whose bytes are an image format qcowfs opens
//                            (image/probe.h; a file that probes as raw counts
//                            only with a disk suffix, .raw .img .iso .bin, or
//                            format= in the options file);
//   MOUNTDIR/<name>.d/       beside every image view: partitions/pN.raw (the
//                            partition windows of directory mode) and, when
//                            the header lists internal snapshots,
//                            snapshots/<snapshot>.raw (read-only);
//   MOUNTDIR/<subdir>/       the same for SRCDIR/<subdir>/, to any depth.
// Names follow directory mode (fuse/inode_table.h raw_view_name()); when two
// files would get one name, the one seen later is shown as <file name>.raw.
// Dot files (.qcowfs.conf, editors' and tools' temporary files) are not
// listed.
//
// Attributes come from a cheap probe of each image's header, without locks
// and without its backing file (image/describe.h: the virtual size, the host
// allocation), redone only when the image file's (st_dev, st_ino), mtime or
// size change, and not at all while the image is open (its driver knows).
// Owner, group and mode are each image file's (uid=/gid=/umask= override);
// chmod/chown of a view (by the mounting user or root) change them for the
// life of the mount, until the image file's own owner or mode change; the
// nodes of <name>.d follow its view's, as directory mode's follow the view.
//
// Live: a directory is re-read (readdir and one fstatat per entry; probes only
// for new or changed files) on every opendir; on a lookup of a listed name
// (<name>.raw or <name>.d) only when its file changed (one stat), of any other
// name when the directory's mtime changed since it was read. An
// entry keeps its inode while its file keeps (st_dev, st_ino); a removed or
// renamed file disappears from the listing, but its node (and an opened
// image) lives on, so an open view keeps working.
//
// Lazy: an image is opened (with its backing chain, locked as QEMU locks it)
// on the first open of its view, through ImageFile::acquire(), and closed by
// close_idle() once it has been unused for the idle delay. Backing files are
// opened through one image::SharedImages, so overlays of one base share it.
// An image that cannot be opened fails only its own opens (EIO, the reason
// logged).
//
// <name>.d: listing it opens nothing; listing partitions/ or snapshots/ (or a
// lookup there when the image file changed since they were read, or the image
// is read-write) holds the image while its table is read. A partition or
// snapshot view holds its image (acquire(): opened, locked, counted as a user)
// from its own first open until its own idle close, so the image closes one
// idle delay after its last view of any kind.
//
// Live snapshots: an image open here has the control socket of a
// single-image mount (fuse/live_snapshot.h): its file is opened and locked
// here and lent to a LiveDriver, and a LiveSnapshots listens on the image's
// socket from the open until the idle close. controls() lists those open now;
// the main thread polls and serves them. `--external` is refused (fuse/DESIGN.md).
//
// Thread-safety: every method may be called concurrently from any event-loop
// thread. mu_ guards the directories and items; refreshes are serialised by
// refresh_mu_ (an AsyncMutex: probes await I/O) and never hold mu_ across a
// co_await. Items are never freed before the catalogue, so a Node handed out
// stays valid for the life of the mount.
#pragma once

#include <sys/stat.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "fuse/access.h"
#include "fuse/catalogue_config.h"
#include "fuse/inode_table.h"
#include "fuse/live_snapshot.h"
#include "image/shared_images.h"
#include "image/views/partition.h"
#include "io/sync.h"

namespace qcowfs::fuse {

// Catalogue inodes start here, far above the one static node (the root).
constexpr Ino kCatalogueInoBase = Ino{1} << 33;

struct CatalogueSettings {
  std::string srcdir;            // absolute
  std::string mountpoint;        // absolute, for messages
  image::ImageOptions defaults;  // from -o: ro/rw, cache=, locking=, key-file=, ...
  CatalogueConfig config;        // SRCDIR/.qcowfs.conf
  AccessOptions access;          // uid=, gid=, umask=, fmask=: over each image file's
  std::chrono::milliseconds idle_timeout{5000};
};

class Catalogue final : public DynamicDirectory {
 public:
  using Clock = ImageFile::Clock;

  // The root directory is kRootIno; it is read by the first refresh(kRootIno).
  explicit Catalogue(CatalogueSettings settings);
  ~Catalogue() override;

  bool has_directory(Ino dir) const override;
  const Node* get(Ino ino) const override;
  const Node* lookup(Ino dir, std::string_view name) const override;
  std::vector<Ino> children(Ino dir) const override;
  std::vector<ImageFile*> image_files() const override;
  Task<Status> refresh(Ino dir) override;
  Task<Status> refresh_name(Ino dir, std::string name) override;
  bool needs_refresh(Ino) const override { return true; }
  std::string_view source() const override { return "the image directory"; }

  // Told when an image's last user released it (from any thread).
  void set_on_idle(std::function<void()> on_idle) { on_idle_ = std::move(on_idle); }
  // Closes every image unused for the idle delay; returns when the next one
  // may be (nullopt: none is open and unused). Close errors are logged.
  Task<std::optional<Clock::time_point>> close_idle();
  // Images open now (main images, not counting shared backing files or
  // partition and snapshot views).
  size_t open_images() const;
  image::SharedImages& shared_backing() { return *shared_; }
  // The control sockets of the images open now. A socket is added by an open
  // (on any thread, which then tells on_idle so the main thread polls again)
  // and removed by the image's close, which runs on the main thread only (the
  // idle close, a live -d's release of snapshot views, shutdown): the main
  // thread may use what this returned until it closes an image itself.
  std::vector<LiveSnapshots*> controls() const;

 private:
  struct Item;
  struct Dir;
  struct Found;  // one entry of a directory as read from the host
  struct Probe;  // what a file's header says
  struct Plan;   // what a re-read does with one entry
  struct SubView;   // a partition or snapshot view in <name>.d
  struct ImageDir;  // <name>.d and its two directories

  Task<Status> rescan(Ino dir);
  Result<std::vector<Found>> read_directory(const std::string& rel) const;
  Task<Probe> probe(std::string path, std::string file_name, image::ImageOptions opts) const;
  Task<Result<std::unique_ptr<image::BlockDriver>>> open_view(Item* item, std::string path, std::string view,
                                                              image::ImageOptions opts);
  Result<std::unique_ptr<LiveSnapshots>> start_control(Item* item, LiveFiles& files, LiveDriver& driver,
                                                       const std::string& view, const image::ImageOptions& opts);
  Task<Status> release_snapshot_views(Item* item, std::string id);  // a live -d: EBUSY if one is in use
  void snapshots_changed(Item* item, const LiveDriver& driver);     // after a live -c or -d
  void remove_control(const LiveSnapshots* control);
  Item* make_item(Dir& dir, const Found& f, std::string view_name);  // mu_ held
  void make_image_dir(Item& item, std::string d_name, std::string path);  // mu_ held
  bool has_image_dir(Ino dir) const;
  Task<Status> refresh_image_dir(Ino dir);
  bool image_dir_stale(Ino dir) const;
  Task<Result<std::unique_ptr<image::BlockDriver>>> open_sub_view(ImageDir* d, SubView* v) const;
  SubView* find_or_make_partition(ImageDir& d, const image::Partition& p);        // mu_ held
  SubView* find_or_make_snapshot(ImageDir& d, const image::SnapshotInfo& s, std::string name);  // mu_ held
  Node make_sub_node(const Item& item, Ino parent, NodeKind kind, std::string name);  // mu_ held
  SubView* add_sub_view(ImageDir& d, std::unique_ptr<SubView> v, bool writable, uint64_t size);  // mu_ held
  std::string path_of(const Dir& dir, const std::string& file_name) const;

  const CatalogueSettings settings_;
  const std::shared_ptr<image::SharedImages> shared_;
  std::function<void()> on_idle_;
  io::AsyncMutex refresh_mu_;
  mutable std::mutex mu_;                       // guards everything below
  std::map<Ino, std::unique_ptr<Dir>> dirs_;    // by the directory's inode (the root: kRootIno)
  std::map<Ino, std::unique_ptr<Item>> items_;  // every item ever made, by inode
  std::map<Ino, ImageDir*> image_dirs_;         // <name>.d and its directories, by inode
  std::map<Ino, const Node*> sub_nodes_;        // every node of a <name>.d, by inode
  Ino next_ino_ = kCatalogueInoBase;
  mutable std::mutex controls_mu_;       // guards controls_ (a leaf lock)
  std::vector<LiveSnapshots*> controls_;  // owned by the open images' drivers
};

}  // namespace qcowfs::fuse
