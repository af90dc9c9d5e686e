#include "fuse/server.h"

#include <fcntl.h>
#include <fuse_lowlevel.h>
#include <mntent.h>
#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "fuse/partitions_dir.h"
#include "fuse/snapshots_dir.h"
#include "image/format.h"
#include "image/views/throwaway.h"
#include "io/forwarding_file.h"
#include "io/log.h"
#include "io/remote/remote_options.h"
#include "io/run_sync.h"

namespace qcowfs::fuse {

// A libfuse session, mounted or not; unmounts and destroys itself.
class MountedSession {
 public:
  explicit MountedSession(fuse_session* se) : se_(se) {}
  ~MountedSession() {
    unmount();
    fuse_session_destroy(se_);
  }
  MountedSession(const MountedSession&) = delete;
  MountedSession& operator=(const MountedSession&) = delete;

  Status mount(const std::string& mountpoint) {
    if (fuse_session_mount(se_, mountpoint.c_str()) != 0)
      return Status::errorf(EIO, "cannot mount on {} (see the message above)", mountpoint);
    mounted_ = true;
    // Every reply passes through the event loops (FUSE over io_uring).
    fuse_custom_io io = {};
    io.writev = &EventLoop::write_reply;
    io.read = [](int fd, void* buf, size_t len, void*) { return ::read(fd, buf, len); };
    if (int r = fuse_session_custom_io(se_, &io, fd()); r != 0)
      return Status::from_errno(r < 0 ? -r : EINVAL, "setting up the FUSE reply path");
    return Status::ok();
  }
  // Lazily detaches the mount (a no-op when the kernel already dropped it).
  void unmount() {
    if (mounted_) fuse_session_unmount(se_);
    mounted_ = false;
  }
  fuse_session* get() const { return se_; }
  int fd() const { return fuse_session_fd(se_); }

 private:
  fuse_session* se_;
  bool mounted_ = false;
};

namespace {

constexpr int kShutdownSignals[] = {SIGINT, SIGTERM, SIGHUP};

struct FuseArgs {
  std::vector<std::string> strings;
  std::vector<char*> argv;
  fuse_args args() {
    argv.clear();
    for (auto& s : strings) argv.push_back(s.data());
    return FUSE_ARGS_INIT(static_cast<int>(argv.size()), argv.data());
  }
};

std::string kernel_mount_options(const Options& o, bool writable) {
  std::string s = "fsname=" + escape_fuse_option(o.printable_image()) + ",subtype=qcowfs,default_permissions";
  if (o.allow_other) s += ",allow_other";
  if (!writable) s += ",ro";
  if (o.debug) s += ",debug";
  return s;
}

Status set_nonblocking(int fd) {
  int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0)
    return Status::from_errno(errno, "setting /dev/fuse non-blocking");
  return Status::ok();
}

// Closes every view (a snapshot, a catalogue image); the first error wins.
Task<Status> close_views(std::vector<ImageFile*> views) {
  Status first;
  for (ImageFile* v : views) {
    Status st = co_await v->close();
    if (first.is_ok() && !st.is_ok()) first = st;
  }
  co_return first;
}

Task<Status> close_all(std::vector<ImageFile*> views, image::BlockDriver& driver) {
  Status first = co_await close_views(std::move(views));
  Status st = co_await driver.close();
  co_return first.is_ok() ? st : first;
}

// Buffer alignment of a catalogue's loops (no driver to ask at start): the
// largest any host needs for O_DIRECT.
constexpr size_t kCatalogueMemAlign = 4096;

// Where a throwaway overlay's unnamed file goes: $TMPDIR, else /var/tmp (as
// QEMU's -snapshot: a disk's writes may outgrow a tmpfs /tmp).
std::string throwaway_directory() {
  const char* dir = std::getenv("TMPDIR");
  return dir && *dir ? dir : "/var/tmp";
}

}  // namespace

std::string escape_fuse_option(std::string_view value) {
  std::string out;
  for (char c : value) {
    if (c == ',' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

Status refuse_if_mounted(const std::string& mountpoint) {
  FILE* mounts = ::setmntent("/proc/self/mounts", "r");
  if (!mounts) return Status::ok();  // no /proc: the kernel stacks the mount as it would anyway
  Status st;
  mntent entry;
  char buf[4096];
  while (::getmntent_r(mounts, &entry, buf, sizeof buf)) {
    std::string_view type = entry.mnt_type;
    if (mountpoint != entry.mnt_dir || !(type == "fuse" || type.starts_with("fuse."))) continue;
    st = Status::errorf(EBUSY, "{} is already mounted ({} from {}); unmount it first: fusermount3 -u {}", mountpoint,
                        type, entry.mnt_fsname, mountpoint);
  }
  ::endmntent(mounts);
  return st;
}

Server::Server(Options opts)
    : opts_(std::move(opts)), status_(opts_.printable_image(), opts_.mountpoint, opts_.status_file) {}

Server::~Server() {
  if (!shut_down_) {
    Status st = shutdown();
    if (!st) log::error("{}", st.to_string());
  }
}

Result<std::unique_ptr<Server>> Server::start(const Options& opts) {
  std::unique_ptr<Server> s(new Server(opts));
  Status st = refuse_if_mounted(opts.mountpoint);
  if (st) st = s->setup_signals();
  struct stat source {};
  const bool catalogue = !io::is_remote_location(opts.image) && ::stat(opts.image.c_str(), &source) == 0 &&
                         S_ISDIR(source.st_mode);
  if (st) st = catalogue ? s->open_catalogue() : s->open_image();
  if (st && s->status_.has_status_file()) st = s->status_.at_mount();
  if (st) st = catalogue ? s->build_catalogue() : s->build_filesystem();
  if (st) st = s->start_control();  // before the mount: a client that sees the mount finds the socket
  if (st) st = s->mount();
  if (st) st = s->start_loops();
  if (st) st = s->wait_until_ready();
  if (!st) {
    // Loops that did start may have served writes: close everything properly.
    Status closed = s->shutdown();
    if (!closed) log::error("{}", closed.to_string());
    return st;
  }
  return s;
}

// Blocks the shutdown signals in this thread (and so in every thread started
// later) and reads them through a signalfd instead.
Status Server::setup_signals() {
  sigset_t set;
  sigemptyset(&set);
  for (int sig : kShutdownSignals) sigaddset(&set, sig);
  sigaddset(&set, SIGUSR1);
  if (pthread_sigmask(SIG_BLOCK, &set, nullptr) != 0) return Status::error(EINVAL, "cannot block signals");
  ::signal(SIGPIPE, SIG_IGN);
  signal_fd_.reset(::signalfd(-1, &set, SFD_CLOEXEC));
  if (!signal_fd_.valid()) return Status::from_errno(errno, "signalfd");
  end_fd_.reset(::eventfd(0, EFD_CLOEXEC));
  if (!end_fd_.valid()) return Status::from_errno(errno, "eventfd");
  ready_fd_.reset(::eventfd(0, EFD_CLOEXEC));
  if (!ready_fd_.valid()) return Status::from_errno(errno, "eventfd");
  return Status::ok();
}

Status Server::open_image() {
  auto engine = io::make_engine(opts_.aio);
  if (!engine) return engine.status();
  main_engine_ = std::move(*engine);
  // A mount of a local overlay comes up with its remote backing file down
  // (image/backing.h): what the overlay holds is served, the rest fails with EIO.
  image::ImageOptions image_options = opts_.image_options;
  image_options.defer_remote_backing = true;
  if (!opts_.throwaway) {
    // The file (or URL) stays open (and locked) across live snapshots' reopens.
    auto file = io::open_host_file(opts_.image, image_options.file);
    if (!file) return file.status();
    live_files_.image = opts_.image;
    live_files_.top = std::move(*file);
    image_options_ = image_options;
    auto lent = std::make_unique<io::ForwardingFile>(*live_files_.top);
    auto driver =
        io::run_sync(*main_engine_, image::open_image_file(std::move(lent), opts_.image, std::move(image_options)));
    if (!driver) return driver.status();
    auto live = std::make_unique<LiveDriver>(std::move(*driver));
    live_ = live.get();
    driver_ = std::move(live);
    log::debug("opened {} ({}, {} bytes, {})", opts_.printable_image(), driver_->format_name(), driver_->size(),
               driver_->read_only() ? "read-only" : "read-write");
    return Status::ok();
  }
  auto driver = io::run_sync(*main_engine_, image::open_image(opts_.image, std::move(image_options)));
  if (!driver) return driver.status();
  if (opts_.throwaway) {
    throwaway_format_ = std::string((*driver)->format_name());
    const std::string dir = throwaway_directory();
    driver = io::run_sync(*main_engine_, image::open_throwaway_overlay(std::move(*driver), opts_.image_options, dir));
    if (!driver) return driver.status();
    log::debug("writes go to a throwaway overlay in {}", dir);
  }
  driver_ = std::move(*driver);
  log::debug("opened {} ({}, {} bytes, {})", opts_.printable_image(), driver_->format_name(), driver_->size(),
             driver_->read_only() ? "read-only" : "read-write");
  return Status::ok();
}

// A catalogue: the options file, then the top directory read once now (the
// mount then starts with its listing; subdirectories are read when opened).
Status Server::open_catalogue() {
  if (!opts_.image_options.snapshot.empty())
    return Status::error(EINVAL, "snapshot= shows one image's snapshot: it cannot be used on a directory of images");
  if (!opts_.image_options.format.empty())
    return Status::errorf(EINVAL, "format= applies to one image: for a directory of images, set it per image in {}/{}",
                          opts_.image, kCatalogueConfigName);
  auto engine = io::make_engine(opts_.aio);
  if (!engine) return engine.status();
  main_engine_ = std::move(*engine);
  auto config = CatalogueConfig::load(opts_.image);
  if (!config) return config.status();
  catalogue_writable_ = opts_.writable() || config->any_writable();
  CatalogueSettings settings;
  settings.srcdir = opts_.image;
  settings.mountpoint = opts_.mountpoint;
  settings.defaults = opts_.image_options;
  settings.config = std::move(*config);
  settings.access = opts_.access;
  settings.idle_timeout = opts_.idle_timeout;
  auto catalogue = std::make_unique<Catalogue>(std::move(settings));
  idle_fd_.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!idle_fd_.valid()) return Status::from_errno(errno, "eventfd");
  catalogue->set_on_idle([fd = idle_fd_.get()] {
    uint64_t one = 1;
    ssize_t n = ::write(fd, &one, sizeof one);
    (void)n;  // a full counter already wakes the main thread
  });
  QCOWFS_TRY(io::run_sync(*main_engine_, catalogue->refresh(kRootIno)));
  pending_catalogue_ = std::move(catalogue);
  return Status::ok();
}

Status Server::build_catalogue() {
  struct stat st;
  if (::stat(opts_.mountpoint.c_str(), &st) != 0) return Status::from_errno(errno, opts_.mountpoint);
  if (!S_ISDIR(st.st_mode))
    return Status::errorf(ENOTDIR, "{}: a directory of images is mounted on a directory", opts_.mountpoint);
  auto ctx = initial_attributes();
  if (!ctx) return ctx.status();
  InodeTable table = InodeTable::directory_root();
  catalogue_ = pending_catalogue_.get();
  table.set_dynamic(std::move(pending_catalogue_));
  fs_ = std::make_unique<Filesystem>(std::move(table), *ctx, Ino{0}, ::getuid());  // no view to chmod
  return Status::ok();
}

// The control socket of a single image, local or a URL (a catalogue's images
// each get theirs while open, fuse/catalogue.h; a throwaway mount's only
// lists and names why it refuses the rest). One that
// cannot be made only loses live snapshots.
Status Server::start_control() {
  const bool throwaway = opts_.throwaway && !io::is_remote_location(opts_.image);
  if (!live_ && !throwaway) return Status::ok();
  LiveSnapshots::Config c;
  if (throwaway) {
    live_files_.image = opts_.image;
    c.throwaway = true;
    c.format = throwaway_format_;
  }
  c.mountpoint = opts_.mountpoint;
  c.options = image_options_;
  c.files = &live_files_;
  c.driver = live_;
  c.writable = writable_mount();
  c.owner = ::getuid();
  c.release_snapshot_view = [this](std::string id) { return release_snapshot_view(std::move(id)); };
  if (io::is_remote_location(opts_.image))
    c.no_external =
        "the old top would be reopened as the new overlay's backing file over a second connection, without QEMU's "
        "locks (a URL has none); use a local overlay on the URL";
  auto control = LiveSnapshots::start(std::move(c));
  if (!control) {
    log::warn("no control socket for {} (no live snapshots): {}", opts_.printable_image(), control.status().to_string());
    return Status::ok();
  }
  control_ = std::move(*control);
  log::debug("control socket {}", control_->socket_path());
  return Status::ok();
}

Task<Status> Server::release_snapshot_view(std::string id) {
  if (!snapshots_dir_) co_return Status::ok();
  co_return co_await snapshots_dir_->release_view(std::move(id));
}

bool Server::writable_mount() const {
  if (catalogue_) return catalogue_writable_;
  return opts_.writable() && !driver_->read_only();
}

Status Server::build_filesystem() {
  struct stat st;
  if (::stat(opts_.mountpoint.c_str(), &st) != 0) return Status::from_errno(errno, opts_.mountpoint);
  const bool writable = opts_.writable() && !driver_->read_only();
  auto main_view = std::make_unique<ImageFile>(driver_.get(), writable);
  main_view_ = main_view.get();
  InodeTable table = InodeTable::directory_root();
  Ino view = kRootIno;
  if (S_ISREG(st.st_mode)) {
    table = InodeTable::file_root(std::move(main_view));
  } else if (S_ISDIR(st.st_mode)) {
    view = table.add_image(kRootIno, raw_view_name(opts_.image), std::move(main_view));
    // A live mount of a format with internal snapshots always has snapshots/
    // (a live -c may add the first one).
    const image::FormatInfo* format = image::find_format(driver_->format_name());
    snapshots_dir_ = add_snapshot_directory(table, *driver_, live_ && format && format->snapshot);
    add_bitmap_directory(table, *driver_);
    add_partition_directory(table, *main_view_, *main_engine_);
  } else {
    return Status::errorf(ENOTDIR, "{}: the mount point must be a regular file or a directory", opts_.mountpoint);
  }
  auto ctx = initial_attributes();
  if (!ctx) return ctx.status();
  fs_ = std::make_unique<Filesystem>(std::move(table), *ctx, view, ::getuid());
  return Status::ok();
}

// The view's owner, group and mode from the image file and the access options.
Result<AttrContext> Server::initial_attributes() const {
  struct stat image {};
  if (io::is_remote_location(opts_.image)) {
    // A URL has no owner here: the mounting user's, mode 0644.
    image.st_uid = ::getuid();
    image.st_gid = ::getgid();
    image.st_mode = S_IFREG | 0644;
  } else if (::stat(opts_.image.c_str(), &image) != 0) {
    return Status::from_errno(errno, opts_.image);
  }
  AttrContext ctx;
  ctx.view = initial_view_attrs(image, opts_.access);
  ctx.dir_mask = opts_.access.dmask.value_or(0);
  ::clock_gettime(CLOCK_REALTIME, &ctx.mount_time);
  log::debug("the view is owned by {}:{}, mode {:03o}{}", ctx.view.uid, ctx.view.gid, ctx.view.mode,
             opts_.allow_other ? " (allow_other)" : "");
  return ctx;
}

Status Server::mount() {
  const bool writable = writable_mount();
  FuseArgs a;
  a.strings = {"qcowfs", "-o", kernel_mount_options(opts_, writable)};
  fuse_args args = a.args();
  const fuse_lowlevel_ops& ops = Filesystem::operations();
  fuse_session* se = fuse_session_new(&args, &ops, sizeof ops, fs_.get());
  fuse_opt_free_args(&args);
  if (!se) return Status::error(EINVAL, "cannot create the FUSE session (see the message above)");
  session_ = std::make_unique<MountedSession>(se);
  QCOWFS_TRY(session_->mount(opts_.mountpoint));
  return set_nonblocking(session_->fd());
}

// Ring entries per kernel queue: enough for a QD32 job or two per CPU (the
// floor daemon, bench/fuse-floor.c, has as many).
constexpr unsigned kRingDepth = 64;
// Entries per loop when several loops share one kernel queue (more loops than CPUs).
constexpr unsigned kMinRingDepth = 16;

RingPlan plan_ring_queues(unsigned loop, unsigned loops, unsigned kernel_queues) {
  RingPlan plan;
  if (kernel_queues == 0 || loops == 0) return plan;
  if (loops <= kernel_queues) {
    // One loop per kernel queue: a request wakes only the loop serving its
    // caller's CPU, and that loop's wake-ups batch the requests of that CPU.
    for (unsigned q = loop; q < kernel_queues; q += loops) plan.qids.push_back(static_cast<uint16_t>(q));
    plan.depth = kRingDepth;
    return plan;
  }
  // More loops than queues: loop i serves queue i % kernel_queues, whose
  // entries the loops serving it share out.
  const unsigned q = loop % kernel_queues;
  const unsigned sharers = (loops - q + kernel_queues - 1) / kernel_queues;
  plan.qids.push_back(static_cast<uint16_t>(q));
  plan.depth = std::max((kRingDepth + sharers - 1) / sharers, kMinRingDepth);
  return plan;
}

Status Server::start_loops() {
  const unsigned n = opts_.queues ? opts_.queues : default_queue_count();
  loop_count_ = n;
  const unsigned kernel_queues = opts_.fuse_uring == FuseUringMode::off ? 0 : possible_cpu_count();
  auto readers = std::make_shared<ReaderGroup>(n);
  for (unsigned i = 0; i < n; ++i) {
    EventLoop::Config cfg;
    cfg.readers = readers;
    cfg.reader_index = i;
    cfg.session = session_->get();
    cfg.fuse_fd = session_->fd();
    cfg.engine_kind = opts_.aio;
    cfg.mem_align = driver_ ? driver_->mem_align() : kCatalogueMemAlign;
    cfg.on_session_end = [this](Status st) { on_session_end(std::move(st)); };
    cfg.on_init = [this] { on_init(); };
    // With -d libfuse traces every request, so it decodes them all.
    if (!opts_.debug)
      cfg.serve_direct = [fs = fs_.get()](std::span<std::byte> message) { return fs->serve_direct(message); };
    cfg.passthrough = wants_passthrough();
    RingPlan plan = plan_ring_queues(i, n, kernel_queues);
    cfg.ring_qids = std::move(plan.qids);
    cfg.ring_depth = plan.depth;
    cfg.on_ring_failure = [this](Status st) { on_ring_failure(std::move(st)); };
    cfg.on_ring_settled = [this] { on_ring_settled(); };
    auto loop = std::make_unique<EventLoop>(std::move(cfg));
    QCOWFS_TRY(loop->start());
    std::lock_guard lk(loops_mu_);
    if (initialized_) loop->start_ring();  // INIT was answered before this loop was listed
    loops_.push_back(std::move(loop));
  }
  log::debug("serving {} on {} with {} queue thread{}", opts_.printable_image(), opts_.mountpoint, n, n == 1 ? "" : "s");
  return Status::ok();
}

void Server::on_ring_settled() {
  if (rings_settled_.fetch_add(1) + 1 != loop_count_) return;
  uint64_t one = 1;
  ssize_t n = ::write(ready_fd_.get(), &one, sizeof one);
  (void)n;  // written once
}

// Waits for the kernel's FUSE_INIT to be answered and every ring to settle (see
// EventLoop::Config::on_ring_settled), or for the session to end first. The
// kernel sends INIT when mounted, so this takes one round trip; a kernel that
// has not done so within kReadyTimeout fails the mount (ETIMEDOUT) rather than
// leaving the command waiting. A signal or an external unmount is left to
// run(): nothing here reads their fds.
Status Server::wait_until_ready() {
  constexpr auto kReadyTimeout = std::chrono::seconds(30);
  const auto deadline = std::chrono::steady_clock::now() + kReadyTimeout;
  pollfd fds[3] = {{ready_fd_.get(), POLLIN, 0}, {end_fd_.get(), POLLIN, 0}, {signal_fd_.get(), POLLIN, 0}};
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    const int n = ::poll(fds, 3, static_cast<int>(std::max<int64_t>(left.count(), 0)));
    if (n > 0) break;
    if (n == 0)
      return Status::errorf(ETIMEDOUT, "the kernel did not start the FUSE session within {} s of mounting",
                            kReadyTimeout.count());
    if (errno != EINTR) return Status::from_errno(errno, "waiting for FUSE_INIT");
  }
  std::lock_guard lk(end_mu_);
  return end_status_;  // an error: the session failed at start (e.g. fuse_uring=on refused)
}

bool Server::wants_passthrough() const {
  return opts_.passthrough && main_view_ && main_view_->passthrough_file() && passthrough::permitted();
}

// On the loop thread that answered FUSE_INIT: the image file is registered for
// passthrough (if the INIT reply claimed it), then every loop sets up its ring.
void Server::on_init() {
  if (wants_passthrough()) register_passthrough();
  start_rings();
}

void Server::register_passthrough() {
  auto backing = passthrough::Backing::open(session_->fd(), main_view_->passthrough_file()->kernel_fd());
  if (!backing) {  // the kernel lacks it (or refused the claim): every read goes through us
    log::debug("no FUSE passthrough: {}", backing.status().to_string());
    return;
  }
  main_view_->enable_passthrough(backing->id());
  log::debug("reads of {} pass through to the image file (FUSE passthrough, backing {})", opts_.printable_image(), backing->id());
  std::lock_guard lk(loops_mu_);
  backing_.emplace(std::move(*backing));
}

void Server::start_rings() {
  std::lock_guard lk(loops_mu_);
  initialized_ = true;
  for (auto& loop : loops_) loop->start_ring();
}

void Server::on_ring_failure(Status st) {
  if (ring_failed_.exchange(true)) return;  // each loop reports the same cause
  if (opts_.fuse_uring == FuseUringMode::on) {  // reported once, as the session's end status
    on_session_end(Status::errorf(st.code() != 0 ? st.code() : EIO,
                                  "fuse_uring=on, but FUSE over io_uring is unavailable ({}): turn on "
                                  "/sys/module/fuse/parameters/enable_uring (as root, before mounting) "
                                  "or mount with fuse_uring=auto",
                                  st.to_string()));
    return;
  }
  log::debug("FUSE over io_uring unavailable ({}): serving through /dev/fuse", st.to_string());
}

void Server::on_session_end(Status st) {
  {
    std::lock_guard lk(end_mu_);
    if (end_status_.is_ok() && !st.is_ok()) end_status_ = std::move(st);
  }
  uint64_t one = 1;
  ssize_t n = ::write(end_fd_.get(), &one, sizeof one);
  (void)n;  // the counter cannot overflow with a handful of writers
}

// Idle metadata write-back: while nothing else happens the main thread wakes
// every kIdleWritebackMs and lets a writable driver write back dirty metadata,
// so nothing dirty is kept for long even without fsync.
constexpr int kIdleWritebackMs = 1000;

// After a failed write-back the next try waits twice as long (up to 64 s), and
// only the first failure of a series is logged, so a dead host disk does not
// flood the log.
constexpr unsigned kMaxIdleBackoffShift = 6;

void Server::idle_writeback() {
  Status st = io::run_sync(*main_engine_, driver_->idle_writeback());
  if (st) {
    if (idle_failures_ > 0) log::info("writing back metadata of {} works again", opts_.printable_image());
    idle_failures_ = 0;
    return;
  }
  if (idle_failures_ == 0)
    log::warn("writing back metadata of {}: {} (retrying with back-off)", opts_.printable_image(), st.to_string());
  ++idle_failures_;
}

int Server::idle_timeout_ms() const {
  if (catalogue_) {
    if (!next_close_) return -1;  // nothing open and unused: no timer (idle CPU 0)
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(*next_close_ - std::chrono::steady_clock::now());
    return static_cast<int>(std::clamp<int64_t>(left.count(), 0, 3'600'000));
  }
  if (driver_->read_only()) return -1;
  return kIdleWritebackMs << std::min(idle_failures_, kMaxIdleBackoffShift);
}

// A catalogue: closes the images unused for the idle delay, and notes when
// the next one may be.
void Server::close_idle_images() {
  uint64_t count = 0;
  ssize_t n = ::read(idle_fd_.get(), &count, sizeof count);  // non-blocking: drains the wake-ups
  (void)n;
  next_close_ = io::run_sync(*main_engine_, catalogue_->close_idle());
}

// Waits on the signal fd, the end fd and (a catalogue) the idle fd; on
// timeouts, the idle write-back or a catalogue's idle closes, and the status
// file's rewrite. SIGUSR1 reports the statistics and goes on waiting.
void Server::wait_for_end() {
  // idle_fd_ is -1 (ignored by poll) unless this is a catalogue. Then come
  // the control sockets: the mount's own, or each open catalogue image's.
  std::vector<pollfd> fds;
  std::vector<LiveSnapshots*> controls;
  for (;;) {
    controls.clear();
    if (control_) controls.push_back(control_.get());  // an external snapshot moves it to the new overlay's
    if (catalogue_)
      for (LiveSnapshots* c : catalogue_->controls()) controls.push_back(c);  // valid until we close an image
    fds.assign({{signal_fd_.get(), POLLIN, 0}, {end_fd_.get(), POLLIN, 0}, {idle_fd_.get(), POLLIN, 0}});
    for (LiveSnapshots* c : controls) fds.push_back({c->fd(), POLLIN, 0});
    int timeout = idle_timeout_ms();
    if (status_.has_status_file()) timeout = timeout < 0 ? kStatusIntervalMs : std::min(timeout, kStatusIntervalMs);
    int n = ::poll(fds.data(), fds.size(), timeout);
    if (n < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (n == 0) {
      if (catalogue_) close_idle_images();
      else if (!driver_->read_only()) idle_writeback();
      status_.refresh();
      continue;
    }
    bool served = false;
    for (size_t i = 0; i < controls.size(); ++i) {
      if (!fds[3 + i].revents) continue;
      controls[i]->serve_one(*main_engine_);  // a live snapshot request
      served = true;
    }
    if (served && !(fds[0].revents | fds[1].revents | fds[2].revents)) continue;
    if (!(fds[0].revents | fds[1].revents)) {
      close_idle_images();  // a view's last user released it, or an image opened its socket
      continue;
    }
    if (!(fds[0].revents & POLLIN)) {
      log::debug("{} was unmounted", opts_.mountpoint);
      return;
    }
    signalfd_siginfo info = {};
    if (::read(signal_fd_.get(), &info, sizeof info) != sizeof info) continue;
    if (info.ssi_signo == SIGUSR1) {
      status_.on_signal();
      continue;
    }
    log::info("{}: unmounting {}", strsignal(static_cast<int>(info.ssi_signo)), opts_.mountpoint);
    return;
  }
}

void Server::log_remotes() { status_.log_identities(); }

Status Server::run() {
  wait_for_end();
  status_.refresh();  // the last numbers, before the files close
  QCOWFS_TRY(shutdown());
  std::lock_guard lk(end_mu_);
  return end_status_;
}

Status Server::shutdown() {
  shut_down_ = true;
  control_.reset();  // no more requests: the socket file goes
  for (auto& loop : loops_) loop->request_stop();
  for (auto& loop : loops_) loop->join();
  {
    std::lock_guard lk(loops_mu_);
    loops_.clear();
  }
  backing_.reset();  // files still open keep the kernel's own reference
  Status closed = close_images();
  if (session_) session_->unmount();
  return closed;
}

Status Server::close_images() {
  if (catalogue_) return io::run_sync(*main_engine_, close_views(fs_->table().image_files()));
  if (!driver_) return Status::ok();
  std::vector<ImageFile*> views;
  if (fs_) views = fs_->table().image_files();
  Status st = io::run_sync(*main_engine_, close_all(std::move(views), *driver_));
  if (!st) return st.with_context(fmt::format("closing {}", opts_.printable_image()));
  return st;
}

}  // namespace qcowfs::fuse
