// Server: one qcowfs mount from start to clean exit.
//
// start(): refuses a mount point that already holds a FUSE mount, opens the
// image (on the main thread's engine), builds the inode
// tree, creates the FUSE session, mounts it (the kernel mount options come
// from Options: ro unless rw, default_permissions (always: the kernel checks
// the view's owner and mode, fuse/access.h), allow_other, fsname) and
// starts the queue threads (EventLoops), then waits until the kernel's
// FUSE_INIT is answered and every loop's FUSE-over-io_uring ring is set up or
// refused: start() returns only once the mount is usable or has failed (so a
// daemonizing caller reports the truth). SIGINT/SIGTERM/SIGHUP are blocked
// in every thread and read through a signalfd by run(); so is SIGUSR1, which
// logs the remote images' statistics (fuse/remote_status.h).
//
// run(): waits for a signal or for the session to end (external unmount,
// seen by a loop as ENODEV), then shuts down in this order:
//   1. loops stop reading /dev/fuse; in-flight requests finish and reply;
//   2. snapshot views, then the image, are closed (everything flushed);
//   3. the mount is removed if it is still there, the session destroyed.
// No acknowledged write is lost: it was replied to only after its driver
// write completed, and close() flushes before the process ends.
//
// A catalogue mount (the image is a directory, fuse/catalogue.h) opens no
// image at start: it reads SRCDIR's options file and top directory, and the
// main thread closes images left unused for the idle delay (woken by an
// eventfd when a view's last user releases it, then at the next deadline;
// with nothing open it sleeps without a timeout).
//
// Thread-safety: start(), run() and destruction on the main thread only.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "fuse/catalogue.h"
#include "fuse/event_loop.h"
#include "fuse/filesystem.h"
#include "fuse/live_snapshot.h"
#include "fuse/options.h"
#include "fuse/passthrough.h"
#include "fuse/remote_status.h"
#include "fuse/snapshots_dir.h"
#include "image/block_driver.h"
#include "io/engine.h"
#include "io/fd.h"
#include "io/status.h"

namespace qcowfs::fuse {

class MountedSession;

class Server {
 public:
  // opts.image and opts.mountpoint must be absolute paths.
  static Result<std::unique_ptr<Server>> start(const Options& opts);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Serves until a signal or an external unmount; ok after a clean shutdown.
  Status run();
  // Logs each remote image file's size, identity and settings (once the log is routed).
  void log_remotes();

 private:
  explicit Server(Options opts);
  Status setup_signals();
  Status open_image();
  Status start_control();
  Task<Status> release_snapshot_view(std::string id);  // for a live -d
  Status open_catalogue();
  Status build_filesystem();
  Status build_catalogue();
  bool writable_mount() const;
  void close_idle_images();
  Result<AttrContext> initial_attributes() const;
  Status mount();
  Status start_loops();
  Status wait_until_ready();
  void on_ring_settled();  // from any loop thread
  void wait_for_end();
  void idle_writeback();
  int idle_timeout_ms() const;
  void on_session_end(Status st);  // from any loop thread
  bool wants_passthrough() const;
  void on_init();                    // from the loop thread that answered INIT
  void register_passthrough();       // from on_init
  void start_rings();                // from on_init
  void on_ring_failure(Status st);   // from any loop thread
  Status shutdown();  // the images' close status (run() adds the session's)
  Status close_images();

  Options opts_;
  RemoteStatusReporter status_;
  bool shut_down_ = false;
  io::UniqueFd signal_fd_;
  io::UniqueFd end_fd_;  // eventfd: a loop saw the session end
  io::UniqueFd ready_fd_;  // eventfd: every loop's ring settled after INIT
  unsigned loop_count_ = 0;
  std::atomic<unsigned> rings_settled_{0};
  std::mutex end_mu_;
  Status end_status_;  // guarded by end_mu_: first /dev/fuse error, if any

  // Destroyed bottom-up: loops before the session, the session before the
  // filesystem it points to, the filesystem (snapshot views) before the image.
  std::unique_ptr<io::Engine> main_engine_;
  unsigned idle_failures_ = 0;  // consecutive failed idle write-backs (main thread only)
  // A local image: its host file, opened (and locked) here and lent to the
  // driver, so that a live snapshot can close and reopen the driver on it
  // (fuse/live_snapshot.h); driver_ is then a LiveDriver (live_).
  LiveFiles live_files_;
  image::ImageOptions image_options_;  // as driver_ was opened
  std::string throwaway_format_;       // a throwaway mount: the image's format (for snapshot -l)
  std::unique_ptr<image::BlockDriver> driver_;
  LiveDriver* live_ = nullptr;
  std::unique_ptr<Filesystem> fs_;
  std::unique_ptr<MountedSession> session_;
  ImageFile* main_view_ = nullptr;  // owned by fs_
  SnapshotDirectory* snapshots_dir_ = nullptr;  // owned by fs_'s table; nullptr: no snapshots/
  std::unique_ptr<LiveSnapshots> control_;  // the control socket, once mounted
  // A catalogue mount: the catalogue (built by open_catalogue(), then owned
  // by fs_'s table), the eventfd its idle views write to, and when the next
  // idle image may be closed.
  std::unique_ptr<Catalogue> pending_catalogue_;
  Catalogue* catalogue_ = nullptr;
  bool catalogue_writable_ = false;
  io::UniqueFd idle_fd_;
  std::optional<std::chrono::steady_clock::time_point> next_close_;
  // Destroyed before the session: unregistered while /dev/fuse is still open.
  std::optional<passthrough::Backing> backing_;  // guarded by loops_mu_ while loops run
  std::mutex loops_mu_;  // loops_ and initialized_: loop threads read them (start_rings)
  bool initialized_ = false;
  std::atomic<bool> ring_failed_{false};
  std::vector<std::unique_ptr<EventLoop>> loops_;
};

// FUSE over io_uring: the kernel queues (one per possible CPU) loop `loop` of
// `loops` serves, and its entries per queue. Every queue has a loop; with no
// more loops than queues each queue has exactly one (bench/RESULTS.md, issue
// 36: with every loop on every queue, two fio jobs cost 1.25-1.6x the floor
// daemon's CPU per 4 KiB request).
struct RingPlan {
  std::vector<uint16_t> qids;
  unsigned depth = 0;
};
RingPlan plan_ring_queues(unsigned loop, unsigned loops, unsigned kernel_queues);

// EBUSY "already mounted" when /proc/self/mounts lists a FUSE mount at
// mountpoint (an absolute, resolved path); mounting again would stack a second one.
Status refuse_if_mounted(const std::string& mountpoint);

// Escapes ',' and '\' for a libfuse -o option value.
std::string escape_fuse_option(std::string_view value);

}  // namespace qcowfs::fuse
