#include "fuse/live_snapshot.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>

#include "image/create.h"
#include "image/format.h"
#include "io/forwarding_file.h"
#include "io/log.h"
#include "io/remote/remote_options.h"
#include "io/run_sync.h"

namespace qcowfs::fuse {
namespace {

// How long a client may take to send its request, and to take the reply.
constexpr auto kControlIoTimeout = std::chrono::seconds(2);
constexpr size_t kMaxControlRequestBytes = 64 * 1024;

image::NewSnapshot live_snapshot_now(const std::string& name) {
  // As qemu-img: the seconds and microseconds of the wall clock.
  auto usec = std::chrono::duration_cast<std::chrono::microseconds>(
                  std::chrono::system_clock::now().time_since_epoch())
                  .count();
  image::NewSnapshot n;
  n.name = name;
  n.date_sec = static_cast<uint32_t>(usec / 1000000);
  n.date_nsec = static_cast<uint32_t>(usec % 1000000 * 1000);
  return n;
}

void send_control_reply(int fd, const image::ControlReply& reply) {
  Status st = io::write_control_text(fd, image::encode_reply(reply) + "\n", io::ControlClock::now() + kControlIoTimeout);
  if (!st) log::debug("control socket: {}", st.to_string());
}

// The new overlay's one file, for the qcow2 Creator; closed when done.
class OverlayFiles final : public image::NewFiles {
 public:
  Result<io::HostFile*> create(const std::string& path) override {
    io::OpenOptions o;
    o.writable = true;
    auto f = io::create_host_file(path, o);
    if (!f) return f.status();
    files_.push_back(std::move(*f));
    return files_.back().get();
  }

 private:
  std::vector<std::unique_ptr<io::HostFile>> files_;
};

}  // namespace

Result<std::unique_ptr<LiveSnapshots>> LiveSnapshots::start(Config config) {
  auto listener = io::ControlListener::open(config.files->image);
  if (!listener) return listener.status();
  return std::unique_ptr<LiveSnapshots>(new LiveSnapshots(std::move(config), std::move(*listener)));
}

LiveSnapshots::LiveSnapshots(Config config, io::ControlListener listener)
    : config_(std::move(config)), listener_(std::move(listener)) {}

void LiveSnapshots::serve_one(io::Engine& engine) {
  auto peer = listener_.accept();
  if (!peer) {
    if (peer.status().code() != EAGAIN) log::warn("control socket {}: {}", socket_path(), peer.status().to_string());
    return;
  }
  const int fd = peer->fd.get();
  if (peer->uid != config_.owner && peer->uid != 0) {
    log::info("control socket: refused uid {} (pid {}): only uid {} and root may use it", peer->uid, peer->pid,
              config_.owner);
    send_control_reply(fd, {Status::errorf(EACCES,
                                   "{} is mounted on {} by uid {}: only that user and root may use the mount's "
                                   "control socket (this is uid {})",
                                   image(), config_.mountpoint, config_.owner, peer->uid),
                    {}});
    return;
  }
  auto line = io::read_control_line(fd, io::ControlClock::now() + kControlIoTimeout, kMaxControlRequestBytes);
  if (!line) {
    log::debug("control socket: {}", line.status().to_string());
    return;
  }
  auto request = image::decode_request(*line);
  image::ControlReply reply;
  if (!request) reply.status = request.status();
  else reply = io::run_sync(engine, handle(std::move(*request)));
  send_control_reply(fd, reply);
}

Task<image::ControlReply> LiveSnapshots::handle_throwaway(image::ControlRequest request) {
  image::ControlReply reply;
  if (request.op != image::ControlOp::list) {
    reply.status = Status::errorf(EBUSY,
                                  "{} is mounted on {} with throwaway writes: they go to a temporary overlay and "
                                  "never reach the image, so a snapshot of it would not hold them; unmount it first",
                                  image(), config_.mountpoint);
    co_return reply;
  }
  const image::FormatInfo* format = image::find_format(config_.format);
  if (!format || !format->snapshot) co_return reply;  // no snapshots: an empty list, as qemu-img
  io::OpenOptions ro;
  ro.locking = io::LockMode::off;  // the mount's shared lock keeps writers out
  auto file = io::open_host_file(image(), ro);
  if (!file) {
    reply.status = file.status();
    co_return reply;
  }
  auto list = co_await format->snapshot->list(**file);
  if (!list) reply.status = list.status();
  else reply.snapshots = std::move(*list);
  co_return reply;
}

Task<image::ControlReply> LiveSnapshots::handle(image::ControlRequest request) {
  if (config_.throwaway) co_return co_await handle_throwaway(std::move(request));
  image::ControlReply reply;
  image::BlockDriver* d = config_.driver->current();
  const image::FormatInfo* format = d ? image::find_format(d->format_name()) : nullptr;
  const image::SnapshotOps* ops = format ? format->snapshot : nullptr;
  switch (request.op) {
    case image::ControlOp::list: {
      if (!ops) co_return reply;  // no snapshots: an empty list, as qemu-img
      co_await config_.driver->pause();  // nothing writes the header meanwhile
      auto list = co_await ops->list(file());
      config_.driver->resume();
      if (!list) reply.status = list.status();
      else reply.snapshots = std::move(*list);
      co_return reply;
    }
    case image::ControlOp::apply:
      reply.status = Status::errorf(EBUSY,
                                    "{} is mounted on {}: applying a snapshot would change the disk under the "
                                    "mount's users; unmount it first",
                                    image(), config_.mountpoint);
      co_return reply;
    case image::ControlOp::create: {
      if (!ops) {
        reply.status = Status::error(ENOTSUP, "");
        co_return reply;
      }
      image::SnapshotEntry made;
      reply.status = co_await create(*ops, request.name, made);
      if (reply.status) reply.snapshots.push_back(std::move(made));
      co_return reply;
    }
    case image::ControlOp::external:
      reply.status = co_await external(request.name);
      co_return reply;
    case image::ControlOp::remove:
      if (!ops) reply.status = Status::error(ENOENT, "snapshot not found");
      else reply.status = co_await remove(*ops, request);
      co_return reply;
  }
  co_return reply;
}

Task<Status> LiveSnapshots::create(const image::SnapshotOps& ops, const std::string& name, image::SnapshotEntry& made) {
  image::ControlRequest r;
  r.name = name;
  co_return co_await with_driver_closed(ops, Change::create, r, made);
}

Status LiveSnapshots::refuse_remove(const image::ControlRequest& request) const {
  const std::string& shown = config_.options.snapshot;
  if (!shown.empty() && (shown == request.id || shown == request.name))
    return Status::errorf(EBUSY, "{} is mounted on {} showing this snapshot; unmount it first", image(),
                          config_.mountpoint);
  return Status::ok();
}

Task<Status> LiveSnapshots::remove(const image::SnapshotOps& ops, const image::ControlRequest& request) {
  QCOWFS_CO_TRY(refuse_remove(request));
  image::SnapshotEntry unused;
  co_return co_await with_driver_closed(ops, Change::remove, request, unused);
}

Task<Status> LiveSnapshots::with_driver_closed(const image::SnapshotOps& ops, Change change,
                                               const image::ControlRequest& request, image::SnapshotEntry& made) {
  const auto started = std::chrono::steady_clock::now();
  if (!config_.driver->current()) co_return config_.driver->broken();  // an earlier reopen failed
  if (!config_.writable && io::is_remote_location(image())) {
    co_return Status::errorf(EROFS,
                             "{} is mounted read-only on {}: a snapshot writes the image, and a URL is not opened "
                             "read-write beside a read-only mount (no locks guard it; HTTP and S3 are never "
                             "writable)",
                             image(), config_.mountpoint);
  }
  co_await config_.driver->pause();
  // Nothing may read a deleted snapshot's clusters: a view of it held open
  // refuses the delete, one open but unused is closed first.
  if (change == Change::remove && config_.release_snapshot_view) {
    Status released = co_await config_.release_snapshot_view(request.id);
    if (!released) {
      config_.driver->resume();
      co_return Status::errorf(EBUSY, "the snapshot is open under {}/; close it first",
                               config_.snapshots_dir.empty() ? config_.mountpoint + "/snapshots" : config_.snapshots_dir);
    }
  }
  // A read-only mount writes through the image opened read-write for this
  // operation only; failing that, the mount goes on as it was.
  std::unique_ptr<io::HostFile> writer;
  if (!config_.writable) {
    auto opened = open_writer();
    if (!opened) {
      config_.driver->resume();
      co_return opened.status();
    }
    writer = std::move(*opened);
  }
  io::HostFile& target = writer ? *writer : file();
  Status st = co_await config_.driver->current()->close();
  if (st && change == Change::create) {
    auto entry = co_await ops.create(target, live_snapshot_now(request.name));
    if (entry) made = std::move(*entry);
    else st = entry.status();
  } else if (st) {
    st = co_await ops.remove(target, request.id, request.name);
  }
  if (st) st = co_await target.flush();
  if (writer) {
    writer.reset();  // its write lock goes
    reopen_reader();
  }
  Status reopened = co_await reopen();
  config_.driver->resume();
  const auto paused_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - started).count();
  log::info("{} snapshot '{}' of {}: {} (requests held for {} ms)", change == Change::create ? "created" : "deleted",
            request.name, image(), st.to_string(), paused_ms);
  if (st && config_.on_snapshots_changed) config_.on_snapshots_changed();
  co_return st ? reopened : st;
}

// A read-only mount's image opened read-write, for one snapshot operation:
// our own shared lock is dropped first (QEMU's lock bytes make it refuse any
// writer, ours included); if the image cannot be opened so (someone else
// uses it, or the file is not writable) the shared lock is taken back
// (reopen_reader()) and the reason returned.
Result<std::unique_ptr<io::HostFile>> LiveSnapshots::open_writer() {
  io::OpenOptions rw = config_.options.file;
  rw.writable = true;
  rw.force_share = false;
  file().hold_lock(io::ImageLock());
  auto writer = io::open_host_file(image(), rw);
  if (writer) return writer;
  reopen_reader();
  return writer.status().with_context(
      fmt::format("{} is mounted read-only on {}; opening it read-write for the snapshot", image(), config_.mountpoint));
}

// After open_writer(): the read-only mount's file opened afresh (its size is
// the file's now, its shared lock taken again); the old one is retired (the
// snapshot views opened from it read through it). Someone who took the image
// in between keeps it: the mount goes on without a lock, and says so.
void LiveSnapshots::reopen_reader() {
  io::OpenOptions ro = config_.options.file;
  auto reader = io::open_host_file(image(), ro);
  if (!reader && ro.locking != io::LockMode::off) {
    log::warn("{}: the read-only mount's lock could not be taken back ({}): it goes on without it", image(),
              reader.status().to_string());
    ro.locking = io::LockMode::off;
    reader = io::open_host_file(image(), ro);
  }
  if (!reader) {
    log::error("{}: reopening read-only: {}", image(), reader.status().to_string());
    return;  // the driver's reopen on the old file then says why the mount fails
  }
  config_.files->retired.push_back(std::move(config_.files->top));
  config_.files->top = std::move(*reader);
}

// The driver again, on the same locked file; if that fails the mount's
// requests fail with EIO from now on (and the reason is logged).
Task<Status> LiveSnapshots::reopen() {
  auto driver = co_await image::open_image_file(std::make_unique<io::ForwardingFile>(file()), image(),
                                                config_.options);
  if (!driver) {
    Status st = driver.status().with_context(fmt::format("reopening {} after the snapshot", image()));
    log::error("{}: every request on {} fails from now on", st.to_string(), config_.mountpoint);
    config_.driver->replace(nullptr, st);
    co_return st;
  }
  config_.driver->replace(std::move(*driver));
  co_return Status::ok();
}

Status LiveSnapshots::refuse_external(const std::string& overlay) const {
  if (!config_.no_external.empty())
    return Status::errorf(ENOTSUP, "{} is served on {}: {}", image(), config_.mountpoint, config_.no_external);
  if (!config_.writable)
    return Status::errorf(EROFS, "{} is mounted read-only on {}: an external snapshot switches a writer", image(),
                          config_.mountpoint);
  if (overlay.empty() || overlay.front() != '/')
    return Status::errorf(EINVAL, "the new overlay '{}' must be an absolute path", overlay);
  struct stat st {};
  if (::lstat(overlay.c_str(), &st) == 0)
    return Status::errorf(EEXIST, "{} exists: an external snapshot makes a new file", overlay);
  return Status::ok();
}

Task<Status> LiveSnapshots::external(const std::string& overlay) {
  QCOWFS_CO_TRY(refuse_external(overlay));
  image::BlockDriver* d = config_.driver->current();
  if (!d) co_return config_.driver->broken();
  const image::FormatInfo* qcow2 = image::find_format("qcow2");
  if (!qcow2 || !qcow2->prepare_create) co_return Status::error(ENOTSUP, "qcow2 images cannot be created");
  image::CreateRequest request;
  request.path = overlay;
  request.size = d->size();
  request.backing_file = image();
  request.backing_format = std::string(d->format_name());
  auto creator = qcow2->prepare_create(request);
  if (!creator) co_return creator.status();

  const auto started = std::chrono::steady_clock::now();
  co_await config_.driver->pause();
  Status st = co_await d->close();
  if (st) {
    OverlayFiles files;
    st = co_await (*creator)->write(files);
    if (!st) ::unlink(overlay.c_str());
  }
  // A failure so far leaves the mount on the old top, reopened as it was.
  Status switched;  // (no co_await in a conditional expression: GCC 12 miscompiles its temporaries)
  if (st) switched = co_await switch_to_overlay(overlay);
  else switched = co_await reopen();
  config_.driver->resume();
  const auto paused_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - started).count();
  log::info("external snapshot of {} onto {}: {} (requests held for {} ms)", request.backing_file, overlay,
            (st ? switched : st).to_string(), paused_ms);
  co_return st ? switched : st;
}

// Paused, the old top closed and the overlay made: the overlay opened and
// locked, the old top's write lock dropped and the old top reopened
// read-only as the overlay's backing driver. Failing before the lock is
// dropped, the old top is reopened as it was; after, the mount fails its
// requests (EIO, logged).
Task<Status> LiveSnapshots::switch_to_overlay(const std::string& overlay) {
  LiveFiles& files = *config_.files;
  io::OpenOptions rw = config_.options.file;
  rw.writable = true;
  auto top = io::open_host_file(overlay, rw);
  if (!top) {
    ::unlink(overlay.c_str());
    Status reopened = co_await reopen();
    co_return reopened ? top.status() : reopened;
  }
  files.top->hold_lock(io::ImageLock());  // the old top: no more write lock
  io::OpenOptions ro = config_.options.file;
  ro.writable = false;
  Status st;
  auto base_file = io::open_host_file(files.image, ro);
  std::unique_ptr<image::BlockDriver> base;
  if (!base_file) {
    st = base_file.status();
  } else {
    image::ImageOptions bo = config_.options;
    bo.file = ro;
    bo.compress_writes = false;
    bo.copy_on_read = false;
    bo.discard_unmap = false;
    auto opened = co_await image::open_image_file(std::move(*base_file), files.image, bo);
    if (opened) base = std::move(*opened);
    else st = opened.status();
  }
  std::unique_ptr<image::BlockDriver> driver;
  if (st) {
    image::ImageOptions oo = config_.options;
    oo.format = "qcow2";
    oo.backing = std::make_shared<image::GivenBacking>(image::GivenBacking{std::move(base)});
    auto opened = co_await image::open_image_file(std::make_unique<io::ForwardingFile>(**top), overlay, oo);
    if (opened) driver = std::move(*opened);
    else st = opened.status();
  }
  if (!st) {
    st = st.with_context(fmt::format("switching {} to {}", files.image, overlay));
    log::error("{}: every request on {} fails from now on", st.to_string(), config_.mountpoint);
    files.retired.push_back(std::move(*top));
    config_.driver->replace(nullptr, st);
    co_return st;
  }
  files.retired.push_back(std::move(files.top));
  files.top = std::move(*top);
  files.image = overlay;
  config_.options.format = "qcow2";  // how a later live snapshot reopens it (the backing by its name)
  config_.driver->replace(std::move(driver));
  // From now on the overlay is the image this socket serves.
  auto listener = io::ControlListener::open(overlay);
  if (!listener) log::warn("no control socket for {}: {}", overlay, listener.status().to_string());
  if (listener) listener_ = std::move(*listener);
  else listener_ = io::ControlListener();
  co_return Status::ok();
}

}  // namespace qcowfs::fuse
