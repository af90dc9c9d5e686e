// LiveSnapshots: the daemon's end of an image's control socket
// (io/control_socket.h, messages in image/snapshot_control.h): `qcowfs
// snapshot -l|-c|-d` on an image this mount holds is done here, without
// unmounting. One per single-image mount (a local file or a URL), and one
// per image a catalogue mount has open (fuse/catalogue.h).
//
// The main thread polls fd() with its other fds and calls serve_one() when it
// is readable: one connection, one request, one reply. A peer that is neither
// the mount's owner nor root (SO_PEERCRED) is answered EACCES; reading the
// request and writing the reply each have a deadline (2 s), so a stuck
// client costs the main thread at most that and never touches FUSE requests,
// which the event-loop threads keep serving.
//
// -l reads the snapshot table from the image file (only this thread changes
// it). -c and -d change refcounts and L2 flags under the open writer's caches,
// so they are done on a closed driver: the LiveDriver is paused (new requests
// queue, admitted ones finish; every write acknowledged before the request is
// in), the driver is closed (everything written back and flushed, bitmaps
// stored, the dirty bit cleared), the format's offline SnapshotOps runs on the
// image's own HostFile (still open, so QEMU's locks never drop), the file is
// flushed, the driver is reopened on the same file and put in place, and the
// queued requests go on. On a read-only mount the same is done, the
// operation writing through the image opened read-write for it alone (the
// mount's shared lock dropped, QEMU's write lock taken: EBUSY if anyone else
// holds the image; then the shared lock taken back) while the mount's own
// file stays read-only (and is opened afresh after, with its shared lock).
// A read-only URL refuses -c and -d (EROFS): it cannot be opened read-write
// beside the mount (no locks; HTTP and S3 never are).
// Refused: -a on any mount (it would change the disk
// under its users), -d of the snapshot a snapshot= mount shows or of one held
// open under snapshots/ (EBUSY, as a QEMU reader's lock refuses qemu-img
// snapshot -d); a view of it opened before and now unused is closed first.
//
// A throwaway mount (QEMU's -snapshot) has a control socket too, so that
// `qcowfs snapshot` names why it cannot act: -l is answered from the image
// file, every other operation refused (EBUSY): the mount's writes go to a
// temporary overlay and never reach IMAGE, so a snapshot of IMAGE would not
// hold them (QEMU's -snapshot likewise locks its base against writers).
//
// --external NEW (QEMU's blockdev-snapshot-sync): paused and closed as
// above, NEW is created (qcow2, backing file: the top image's path and format,
// its size), opened read-write and locked; then the old top's write lock is
// dropped and it is reopened read-only with the shared read lock (so qemu-img
// info, check, convert and compare may read it while the mount goes on), given
// to NEW as its backing driver, and NEW becomes the driver the mount writes
// (and the image whose control socket this is). The old top is then a stable
// point-in-time image.
//
// Thread-safety: the main thread only.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "fuse/live_driver.h"
#include "image/block_driver.h"
#include "image/snapshot_control.h"
#include "io/control_socket.h"
#include "io/engine.h"
#include "io/host_file.h"

namespace qcowfs::fuse {

// The host files of a live mount's image: the top image's (locked, lent to
// the driver through ForwardingFiles) and those an external snapshot replaced,
// kept for the drivers (closed, or snapshot views) that still point at them.
struct LiveFiles {
  std::string image;  // the top image's path (absolute)
  std::unique_ptr<io::HostFile> top;
  std::vector<std::unique_ptr<io::HostFile>> retired;
};

class LiveSnapshots {
 public:
  struct Config {
    std::string mountpoint;          // for messages
    image::ImageOptions options;     // how the image was opened, for reopening
    LiveFiles* files = nullptr;      // the server's; outlives this object
    LiveDriver* driver = nullptr;    // the mount's driver, outlives this object
    bool writable = false;           // the mount writes the image
    uid_t owner = 0;                 // the mounting user
    // A throwaway mount (files->top and driver null): -l reads the image's
    // table (the file opened read-only without a lock: nothing writes it
    // while so mounted); every other operation is refused, naming the reason.
    // The image's format, for -l.
    bool throwaway = false;
    std::string format;
    // Closes the unused snapshots/ views of a snapshot id; an error (EBUSY)
    // when one is held open. Called while the driver is paused.
    std::function<Task<Status>(std::string id)> release_snapshot_view;
    // Where those views are, for messages ("": mountpoint/snapshots).
    std::string snapshots_dir;
    // Told after a live -c or -d changed the snapshot table (may be empty).
    std::function<void()> on_snapshots_changed;
    // Non-empty: --external is refused (ENOTSUP) with this reason (a
    // catalogue image: fuse/DESIGN.md).
    std::string no_external;
  };

  // Listens on the image's control socket.
  static Result<std::unique_ptr<LiveSnapshots>> start(Config config);

  int fd() const { return listener_.fd(); }
  const std::string& socket_path() const { return listener_.path(); }
  // Accepts and answers one waiting connection (if any) on engine (this thread's).
  void serve_one(io::Engine& engine);

 private:
  LiveSnapshots(Config config, io::ControlListener listener);
  Task<image::ControlReply> handle(image::ControlRequest request);
  Task<image::ControlReply> handle_throwaway(image::ControlRequest request);
  Task<Status> create(const image::SnapshotOps& ops, const std::string& name, image::SnapshotEntry& made);
  Task<Status> remove(const image::SnapshotOps& ops, const image::ControlRequest& request);
  Task<Status> external(const std::string& overlay);
  Task<Status> switch_to_overlay(const std::string& overlay);
  Status refuse_external(const std::string& overlay) const;
  const std::string& image() const { return config_.files->image; }
  io::HostFile& file() const { return *config_.files->top; }
  Status refuse_remove(const image::ControlRequest& request) const;
  // The image quiesced and its driver closed around one offline operation.
  enum class Change { create, remove };
  Task<Status> with_driver_closed(const image::SnapshotOps& ops, Change change, const image::ControlRequest& request,
                                  image::SnapshotEntry& made);
  Task<Status> reopen();
  Result<std::unique_ptr<io::HostFile>> open_writer();
  void reopen_reader();

  Config config_;
  io::ControlListener listener_;
};

}  // namespace qcowfs::fuse
