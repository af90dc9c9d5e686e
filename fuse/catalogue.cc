#include "fuse/catalogue.h"

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <set>
#include <utility>

#include "image/describe.h"
#include "image/format.h"
#include "image/forwarding_driver.h"
#include "image/probe.h"
#include "image/views/window.h"
#include "io/forwarding_file.h"
#include "io/log.h"

namespace qcowfs::fuse {
namespace {

// A directory whose mtime is this close to the moment it was read may change
// again within the same timestamp tick: it is not trusted for skipping a
// re-read (as git treats a "racily clean" index).
constexpr auto kRacyWindow = std::chrono::seconds(2);

bool same_time(const timespec& a, const timespec& b) { return a.tv_sec == b.tv_sec && a.tv_nsec == b.tv_nsec; }

// A file whose bytes probe as raw is listed only when its name says it is a
// disk: a catalogue directory also holds checksums, notes and scripts.
bool has_disk_suffix(std::string_view name) {
  for (std::string_view s : {".raw", ".img", ".iso", ".bin"})
    if (name.size() > s.size() && name.ends_with(s)) return true;
  return false;
}

// A file whose name says it is an image (listed even when it cannot be probed:
// its open then says why it fails).
bool has_image_suffix(std::string_view name) {
  return has_disk_suffix(name) || raw_view_name(name) != std::string(name) + ".raw";
}

std::string join_path(const std::string& dir, const std::string& name) { return dir.empty() ? name : dir + "/" + name; }

struct DirCloser {
  void operator()(DIR* d) const { ::closedir(d); }
};

// A partition window or a snapshot of a catalogue image, holding the image
// (one user of its ImageFile) until it is closed: the image stays open, and
// its driver valid, while the view is. Everything else is forwarded.
class ImageHoldingDriver final : public image::ForwardingDriver {
 public:
  // image: acquired by the caller; released on close() (or destruction).
  ImageHoldingDriver(std::unique_ptr<image::BlockDriver> inner, ImageFile& image)
      : ForwardingDriver(std::move(inner)), image_(&image) {}
  ~ImageHoldingDriver() override {
    drop_inner();  // a snapshot borrows the image's files: gone before the image may close
    give_back();
  }

  Task<Status> close() override {
    Status st = co_await inner().close();
    give_back();
    co_return st;
  }
  std::optional<image::MappedRead> map_read(uint64_t off, uint64_t len) override {  // the bytes are the image's
    return inner().map_read(off, len);
  }

 private:
  void give_back() {
    if (ImageFile* image = std::exchange(image_, nullptr)) image->release();
  }
  ImageFile* image_;
};

// A catalogue image opened live: its host file (locked, lent to the driver)
// and the LiveDriver in front of its driver, and its control socket while it
// is open. Destroyed on the main thread (see Catalogue::controls()): the
// socket is unregistered (no longer polled), the driver goes, then the files
// it pointed to (and the lock), and last the socket file.
class LiveImageDriver final : public image::ForwardingDriver {
 public:
  using Unregister = std::function<void(const LiveSnapshots*)>;
  LiveImageDriver(std::unique_ptr<LiveFiles> files, std::unique_ptr<LiveDriver> driver)
      : ForwardingDriver(std::move(driver)), files_(std::move(files)) {}
  ~LiveImageDriver() override {
    if (control_) unregister_(control_.get());
    drop_inner();
    files_.reset();    // the image's lock goes
    control_.reset();  // then its socket: a client that finds none may open the file
  }
  void set_control(std::unique_ptr<LiveSnapshots> control, Unregister unregister) {
    control_ = std::move(control);
    unregister_ = std::move(unregister);
  }
  io::HostFile* identity_file() override { return inner().identity_file(); }  // the bytes are the image's
  std::optional<image::MappedRead> map_read(uint64_t off, uint64_t len) override {  // the bytes are the image's
    return inner().map_read(off, len);
  }

 private:
  std::unique_ptr<LiveFiles> files_;
  std::unique_ptr<LiveSnapshots> control_;
  Unregister unregister_;
};

}  // namespace

struct Catalogue::Found {
  std::string name;
  struct stat st = {};
};

struct Catalogue::Probe {
  bool is_image = false;
  uint64_t size = 0;
  uint64_t allocated = 0;
  bool has_snapshots = false;
};

// A view in <name>.d/partitions/ or <name>.d/snapshots/. Its node, key and
// ImageFile never change once made.
struct Catalogue::SubView {
  Node node;
  bool snapshot = false;
  image::Partition partition;  // a partition: where it is
  image::SnapshotInfo info;    // a snapshot: which
};

// <name>.d beside an image view, with partitions/ and snapshots/. The
// listings, has_snapshots and the *_read stats are guarded by mu_.
struct Catalogue::ImageDir {
  Item* item = nullptr;
  std::string path;  // the image file (absolute), as named when its view was made
  Node dnode;        // <name>.d
  Node parts;        // <name>.d/partitions
  Node snaps;        // <name>.d/snapshots
  bool has_snapshots = false;  // the header (or the opened image) lists snapshots: snapshots/ is shown
  std::vector<std::unique_ptr<SubView>> all;  // every view ever made
  std::vector<SubView*> partitions;           // the listings
  std::vector<SubView*> snapshots;
  // The image file's stat when partitions/ or snapshots/ was last read (nullopt: never).
  std::optional<struct stat> parts_read;
  std::optional<struct stat> snaps_read;
};

struct Catalogue::Item {
  Node node;
  std::string file_name;  // in its directory
  struct stat st = {};    // what the attributes were read from
  std::unique_ptr<ImageDir> sub;  // image views: <name>.d (nullptr: its name was taken)
};

struct Catalogue::Dir {
  Ino ino = 0;
  std::string rel;              // relative to SRCDIR; "" for the root
  std::vector<Item*> listing;   // in name order
  // The directory's mtime when it was last read; nullopt: never read, or read
  // too soon after it changed to be trusted.
  std::optional<timespec> read_mtime;
  // Files read before that are not images, with the stat they were probed with.
  std::map<std::string, struct stat> not_images;
};

namespace {
bool same_file(const struct stat& a, const struct stat& b) {
  return a.st_dev == b.st_dev && a.st_ino == b.st_ino && (S_ISDIR(a.st_mode) == S_ISDIR(b.st_mode));
}
bool unchanged(const struct stat& a, const struct stat& b) {
  return same_file(a, b) && a.st_size == b.st_size && same_time(a.st_mtim, b.st_mtim);
}
}  // namespace

Catalogue::Catalogue(CatalogueSettings settings)
    : settings_(std::move(settings)), shared_(std::make_shared<image::SharedImages>()) {
  auto root = std::make_unique<Dir>();
  root->ino = kRootIno;
  dirs_.emplace(kRootIno, std::move(root));
}

Catalogue::~Catalogue() = default;

bool Catalogue::has_directory(Ino dir) const {
  std::lock_guard lk(mu_);
  return dirs_.contains(dir) || image_dirs_.contains(dir);
}

const Node* Catalogue::get(Ino ino) const {
  std::lock_guard lk(mu_);
  if (auto it = items_.find(ino); it != items_.end()) return &it->second->node;
  auto it = sub_nodes_.find(ino);
  return it == sub_nodes_.end() ? nullptr : it->second;
}

const Node* Catalogue::lookup(Ino dir, std::string_view name) const {
  std::lock_guard lk(mu_);
  if (auto it = dirs_.find(dir); it != dirs_.end()) {
    for (const Item* item : it->second->listing) {
      if (item->node.name == name) return &item->node;
      if (item->sub && item->sub->dnode.name == name) return &item->sub->dnode;
    }
    return nullptr;
  }
  auto it = image_dirs_.find(dir);
  if (it == image_dirs_.end()) return nullptr;
  const ImageDir& d = *it->second;
  if (dir == d.dnode.ino) {
    if (name == d.parts.name) return &d.parts;
    if (name == d.snaps.name && d.has_snapshots) return &d.snaps;
    return nullptr;
  }
  for (const SubView* v : dir == d.parts.ino ? d.partitions : d.snapshots)
    if (v->node.name == name) return &v->node;
  return nullptr;
}

std::vector<Ino> Catalogue::children(Ino dir) const {
  std::lock_guard lk(mu_);
  std::vector<Ino> out;
  if (auto it = dirs_.find(dir); it != dirs_.end()) {
    for (const Item* item : it->second->listing) {
      out.push_back(item->node.ino);
      if (item->sub) out.push_back(item->sub->dnode.ino);
    }
    return out;
  }
  auto it = image_dirs_.find(dir);
  if (it == image_dirs_.end()) return out;
  const ImageDir& d = *it->second;
  if (dir == d.dnode.ino) {
    out.push_back(d.parts.ino);
    if (d.has_snapshots) out.push_back(d.snaps.ino);
    return out;
  }
  for (const SubView* v : dir == d.parts.ino ? d.partitions : d.snapshots) out.push_back(v->node.ino);
  return out;
}

// Partition and snapshot views first: each holds its image, and a shutdown
// closes the files in this order.
std::vector<ImageFile*> Catalogue::image_files() const {
  std::lock_guard lk(mu_);
  std::vector<ImageFile*> out;
  for (const auto& [ino, item] : items_)
    if (item->sub)
      for (const auto& v : item->sub->all) out.push_back(v->node.file.get());
  for (const auto& [ino, item] : items_)
    if (item->node.file) out.push_back(item->node.file.get());
  return out;
}

size_t Catalogue::open_images() const {
  std::lock_guard lk(mu_);
  size_t n = 0;
  for (const auto& [ino, item] : items_)
    if (item->node.file && item->node.file->is_open()) ++n;  // is_open() takes only the file's own lock
  return n;
}

std::string Catalogue::path_of(const Dir& dir, const std::string& file_name) const {
  return settings_.srcdir + "/" + join_path(dir.rel, file_name);
}

Result<std::vector<Catalogue::Found>> Catalogue::read_directory(const std::string& rel) const {
  const std::string path = rel.empty() ? settings_.srcdir : settings_.srcdir + "/" + rel;
  std::unique_ptr<DIR, DirCloser> d(::opendir(path.c_str()));
  if (!d) return Status::from_errno(errno, path);
  std::vector<Found> out;
  while (const dirent* e = ::readdir(d.get())) {
    Found f;
    f.name = e->d_name;
    if (f.name.front() == '.') continue;  // ".", "..", .qcowfs.conf, temporary files
    if (::fstatat(::dirfd(d.get()), e->d_name, &f.st, 0) != 0) continue;  // gone, or a dangling link
    if (S_ISREG(f.st.st_mode) || S_ISDIR(f.st.st_mode)) out.push_back(std::move(f));
  }
  std::sort(out.begin(), out.end(), [](const Found& a, const Found& b) { return a.name < b.name; });
  return out;
}

Task<Catalogue::Probe> Catalogue::probe(std::string path, std::string file_name, image::ImageOptions opts) const {
  Probe out;
  io::OpenOptions o = opts.file;
  o.writable = false;
  o.locking = io::LockMode::off;  // a listing holds no locks
  o.cache.reset();
  auto file = io::open_host_file(path, o);
  if (!file) {
    log::debug("{}: {}", path, file.status().to_string());
    out.is_image = has_image_suffix(file_name);
    co_return out;
  }
  const image::FormatInfo* format = opts.format.empty() ? nullptr : image::find_format(opts.format);
  if (!format) {
    auto probed = co_await image::probe_format_info(**file);
    if (!probed) {
      out.is_image = has_image_suffix(file_name);
      co_return out;
    }
    format = *probed;
  }
  if (!format->supported()) co_return out;
  if (format->name == "raw" && opts.format.empty() && !has_disk_suffix(file_name)) co_return out;
  out.is_image = true;
  image::ImageOptions d;
  d.format = std::string(format->name);
  d.file = o;
  auto desc = co_await image::describe_image(*format, std::move(*file), path, std::move(d));
  if (!desc) {  // listed with size 0: its open says why
    log::debug("{}: {}", path, desc.status().to_string());
    co_return out;
  }
  out.size = desc->virtual_size;
  out.allocated = desc->actual_size;
  out.has_snapshots = !desc->snapshots.empty();
  co_return out;
}

// The image's file is opened (and locked) here and lent to its driver, which
// a LiveDriver fronts, so that a live snapshot can close and reopen the
// driver on the same locked file; the image's control socket listens until
// the idle close. A socket that cannot be made only loses live snapshots.
Task<Result<std::unique_ptr<image::BlockDriver>>> Catalogue::open_view(Item* item, std::string path, std::string view,
                                                                       image::ImageOptions opts) {
  auto files = std::make_unique<LiveFiles>();
  files->image = path;
  auto file = io::open_host_file(path, opts.file);
  if (!file) {
    log::error("{}: cannot open {}: {}", view, path, file.status().to_string());
    co_return Status::errorf(EIO, "{}: {}", path, file.status().message());
  }
  files->top = std::move(*file);
  auto d = co_await image::open_image_file(std::make_unique<io::ForwardingFile>(*files->top), path, opts);
  if (!d) {
    log::error("{}: cannot open {}: {}", view, path, d.status().to_string());
    co_return Status::errorf(EIO, "{}: {}", path, d.status().message());
  }
  log::debug("opened {} ({}, {})", path, (*d)->format_name(), (*d)->read_only() ? "read-only" : "read-write");
  auto live = std::make_unique<LiveDriver>(std::move(*d));
  LiveDriver& driver = *live;
  LiveFiles& lent = *files;
  auto out = std::make_unique<LiveImageDriver>(std::move(files), std::move(live));
  auto control = start_control(item, lent, driver, view, opts);
  if (!control) {
    log::warn("no control socket for {} (no live snapshots): {}", path, control.status().to_string());
    co_return std::unique_ptr<image::BlockDriver>(std::move(out));
  }
  LiveSnapshots* raw = control->get();
  out->set_control(std::move(*control), [this](const LiveSnapshots* c) { remove_control(c); });
  {
    std::lock_guard lk(controls_mu_);
    controls_.push_back(raw);
  }
  if (on_idle_) on_idle_();  // wakes the main thread, which then polls the new socket
  co_return std::unique_ptr<image::BlockDriver>(std::move(out));
}

Result<std::unique_ptr<LiveSnapshots>> Catalogue::start_control(Item* item, LiveFiles& files, LiveDriver& driver,
                                                                const std::string& view,
                                                                const image::ImageOptions& opts) {
  LiveSnapshots::Config c;
  c.mountpoint = settings_.mountpoint + "/" + view;
  c.options = opts;
  c.files = &files;
  c.driver = &driver;
  c.writable = opts.file.writable && !driver.read_only();
  c.owner = ::getuid();
  std::string d_name;
  {
    std::lock_guard lk(mu_);
    if (item->sub) d_name = item->sub->dnode.name;
  }
  const std::string rel_dir = view.substr(0, view.size() - item->node.name.size());  // "" or "sub/dir/"
  c.snapshots_dir = fmt::format("{}/{}{}/snapshots", settings_.mountpoint, rel_dir, d_name);
  c.release_snapshot_view = [this, item](std::string id) { return release_snapshot_views(item, std::move(id)); };
  c.on_snapshots_changed = [this, item, &driver] { snapshots_changed(item, driver); };
  c.no_external =
      "a catalogue view always shows its file in the source directory (and goes back to it at its next open), so "
      "it cannot switch to a new overlay; mount the image on its own for --external";
  return LiveSnapshots::start(std::move(c));
}

void Catalogue::remove_control(const LiveSnapshots* control) {
  std::lock_guard lk(controls_mu_);
  std::erase(controls_, control);
}

std::vector<LiveSnapshots*> Catalogue::controls() const {
  std::lock_guard lk(controls_mu_);
  return controls_;
}

// A live -d, the image paused: the unused views of the snapshot in
// <name>.d/snapshots/ are closed (each gives its hold on the image back);
// one in use refuses the delete, as a QEMU reader's lock would.
Task<Status> Catalogue::release_snapshot_views(Item* item, std::string id) {
  std::vector<ImageFile*> views;
  {
    std::lock_guard lk(mu_);
    if (item->sub)
      for (const auto& v : item->sub->all)
        if (v->snapshot && v->info.id == id) views.push_back(v->node.file.get());
  }
  for (ImageFile* v : views) {
    auto closed = co_await v->close_if_unused();  // never waits: an open under way waits for the paused driver
    if (!closed) co_return closed.status();
    if (!*closed) co_return Status::errorf(EBUSY, "snapshot {} is open", id);
  }
  co_return Status::ok();
}

// After a live -c or -d: <name>.d/snapshots/ is shown when the image has
// snapshots, and its listing is read again at the next look.
void Catalogue::snapshots_changed(Item* item, const LiveDriver& driver) {
  const bool any = driver.current() && !driver.snapshots().empty();
  std::lock_guard lk(mu_);
  if (!item->sub) return;
  item->sub->has_snapshots = any;
  item->sub->snaps_read.reset();
}

Catalogue::Item* Catalogue::make_item(Dir& dir, const Found& f, std::string view_name) {
  auto item = std::make_unique<Item>();
  item->file_name = f.name;
  item->st = f.st;
  Node& n = item->node;
  n.ino = next_ino_++;
  n.parent = dir.ino;
  n.name = std::move(view_name);
  n.access = std::make_shared<ViewAccess>(initial_view_attrs(f.st, settings_.access));
  n.own_access = !S_ISDIR(f.st.st_mode);
  if (S_ISDIR(f.st.st_mode)) {
    n.kind = NodeKind::directory;
    auto sub = std::make_unique<Dir>();
    sub->ino = n.ino;
    sub->rel = join_path(dir.rel, f.name);
    dirs_.emplace(n.ino, std::move(sub));
  } else {
    n.kind = NodeKind::image;
    image::ImageOptions opts = settings_.config.options_for(join_path(dir.rel, f.name), settings_.defaults);
    opts.shared_backing = shared_;
    const bool writable = opts.file.writable;
    n.file = std::make_unique<ImageFile>(
        [this, raw = item.get(), path = path_of(dir, f.name), view = join_path(dir.rel, n.name), opts] {
          return open_view(raw, path, view, opts);
        },
        writable);
    n.file->set_on_idle([this] {
      if (on_idle_) on_idle_();
    });
  }
  Item* raw = item.get();
  items_.emplace(raw->node.ino, std::move(item));
  return raw;
}

Node Catalogue::make_sub_node(const Item& item, Ino parent, NodeKind kind, std::string name) {
  Node n;
  n.ino = next_ino_++;
  n.parent = parent;
  n.kind = kind;
  n.name = std::move(name);
  n.access = item.node.access;  // follows the image view's owner and mode
  return n;
}

void Catalogue::make_image_dir(Item& item, std::string d_name, std::string path) {
  auto d = std::make_unique<ImageDir>();
  d->item = &item;
  d->path = std::move(path);
  d->dnode = make_sub_node(item, item.node.parent, NodeKind::directory, std::move(d_name));
  d->parts = make_sub_node(item, d->dnode.ino, NodeKind::directory, "partitions");
  d->snaps = make_sub_node(item, d->dnode.ino, NodeKind::directory, "snapshots");
  for (const Node* n : {&d->dnode, &d->parts, &d->snaps}) {
    sub_nodes_.emplace(n->ino, n);
    image_dirs_.emplace(n->ino, d.get());
  }
  item.sub = std::move(d);
}

Catalogue::SubView* Catalogue::find_or_make_partition(ImageDir& d, const image::Partition& p) {
  for (const auto& v : d.all)
    if (!v->snapshot && v->partition.number == p.number && v->partition.offset == p.offset &&
        v->partition.size == p.size)
      return v.get();
  auto v = std::make_unique<SubView>();
  v->partition = p;
  v->node = make_sub_node(*d.item, d.parts.ino, NodeKind::image, fmt::format("p{}.raw", p.number));
  // A partition of a read-write image is read-write, as in directory mode.
  return add_sub_view(d, std::move(v), d.item->node.file->writable(), p.size);
}

Catalogue::SubView* Catalogue::find_or_make_snapshot(ImageDir& d, const image::SnapshotInfo& s, std::string name) {
  for (const auto& v : d.all)
    if (v->snapshot && v->info.id == s.id && v->info.name == s.name && v->info.disk_size == s.disk_size &&
        v->node.name == name)
      return v.get();
  auto v = std::make_unique<SubView>();
  v->snapshot = true;
  v->info = s;
  v->node = make_sub_node(*d.item, d.snaps.ino, NodeKind::image, std::move(name));
  return add_sub_view(d, std::move(v), false, s.disk_size);  // a snapshot is read-only
}

// A new partition or snapshot view (its node made): its lazily opening
// ImageFile, registered with the image's directory.
Catalogue::SubView* Catalogue::add_sub_view(ImageDir& d, std::unique_ptr<SubView> v, bool writable, uint64_t size) {
  v->node.file = std::make_unique<ImageFile>([this, dp = &d, vp = v.get()] { return open_sub_view(dp, vp); },
                                             writable);
  v->node.file->set_closed_attributes(size, 0);
  v->node.file->set_on_idle([this] {
    if (on_idle_) on_idle_();
  });
  sub_nodes_.emplace(v->node.ino, &v->node);
  d.all.push_back(std::move(v));
  return d.all.back().get();
}

// The first open of a partition or snapshot view: its image is acquired
// (opened if closed, with its locks and mode) and held by the view's driver
// until the view closes. Failures are the view's alone: EIO, logged.
Task<Result<std::unique_ptr<image::BlockDriver>>> Catalogue::open_sub_view(ImageDir* d, SubView* v) const {
  const std::string view = fmt::format("{}/{}/{}", d->dnode.name, v->snapshot ? "snapshots" : "partitions",
                                       v->node.name);
  ImageFile& image = *d->item->node.file;
  Status st = co_await image.acquire();
  if (!st) {  // the image's own open has logged why
    log::error("{}: its image {} cannot be opened", view, d->path);
    co_return Status::errorf(EIO, "{}: {}", view, st.message());
  }
  image::BlockDriver* disk = image.driver();
  std::unique_ptr<image::BlockDriver> inner;
  if (v->snapshot) {
    auto snap = co_await disk->open_snapshot(v->info.id);
    if (!snap) {
      image.release();
      log::error("{}: cannot open snapshot {} of {}: {}", view, v->info.id, d->path, snap.status().to_string());
      co_return Status::errorf(EIO, "{}: {}", view, snap.status().message());
    }
    inner = std::move(*snap);
  } else {
    const image::Partition& p = v->partition;
    if (p.offset > disk->size() || p.size > disk->size() - p.offset) {
      image.release();
      log::error("{}: the partition no longer fits the disk of {} (its table changed)", view, d->path);
      co_return Status::errorf(EIO, "{}: the partition is outside the disk", view);
    }
    inner = std::make_unique<image::WindowDriver>(disk, p.offset, p.size);
  }
  co_return std::unique_ptr<image::BlockDriver>(std::make_unique<ImageHoldingDriver>(std::move(inner), image));
}

bool Catalogue::has_image_dir(Ino dir) const {
  std::lock_guard lk(mu_);
  return image_dirs_.contains(dir);
}

// partitions/ or snapshots/ is re-read when it never was, when the image file
// changed since (not while we hold it: the lock keeps writers out), or always
// for a read-write image (a write through the mount may not show in the
// file's stat yet).
bool Catalogue::image_dir_stale(Ino dir) const {
  std::optional<struct stat> read;
  std::string path;
  {
    std::lock_guard lk(mu_);
    auto it = image_dirs_.find(dir);
    if (it == image_dirs_.end() || dir == it->second->dnode.ino) return false;
    const ImageDir& d = *it->second;
    if (d.item->node.file->writable()) return true;
    read = dir == d.parts.ino ? d.parts_read : d.snaps_read;
    path = d.path;
  }
  struct stat st;
  return !read || ::stat(path.c_str(), &st) != 0 || !unchanged(*read, st);
}

Task<Status> Catalogue::refresh_image_dir(Ino dir) {
  ImageDir* d = nullptr;
  bool partitions = false;
  {
    std::lock_guard lk(mu_);
    auto it = image_dirs_.find(dir);
    if (it == image_dirs_.end() || dir == it->second->dnode.ino) co_return Status::ok();  // <name>.d: fixed
    d = it->second;
    partitions = dir == d->parts.ino;
  }
  ImageFile& image = *d->item->node.file;
  Status st = co_await image.acquire();  // the image's open logs why it fails
  if (!st)
    co_return st.with_context(fmt::format("listing {}/{}", d->dnode.name, partitions ? "partitions" : "snapshots"));
  struct stat fst;
  std::optional<struct stat> read_st;
  if (::stat(d->path.c_str(), &fst) == 0) read_st = fst;
  image::BlockDriver& disk = *image.driver();
  if (partitions) {
    auto table = co_await image::read_partition_table(disk);
    image.release();
    if (!table) co_return table.status().with_context(fmt::format("the partition table of {}", d->path));
    std::lock_guard lk(mu_);
    d->partitions.clear();
    for (const image::Partition& p : table->partitions) d->partitions.push_back(find_or_make_partition(*d, p));
    d->parts_read = read_st;
    co_return Status::ok();
  }
  const std::vector<image::SnapshotInfo> snaps = disk.snapshots();
  image.release();
  std::lock_guard lk(mu_);
  d->snapshots.clear();
  std::vector<std::string> taken;
  for (const image::SnapshotInfo& s : snaps) {
    std::string name = snapshot_file_name(s.name, s.id, taken);
    taken.push_back(name);
    d->snapshots.push_back(find_or_make_snapshot(*d, s, std::move(name)));
  }
  d->has_snapshots = !snaps.empty();
  d->snaps_read = read_st;
  co_return Status::ok();
}

Task<Status> Catalogue::refresh(Ino dir) {
  if (has_image_dir(dir)) co_return co_await refresh_image_dir(dir);
  auto guard = co_await refresh_mu_.lock();
  co_return co_await rescan(dir);
}

// One entry of a re-read: the file, the item it had (if any), and a probe when
// its bytes must be looked at again.
struct Catalogue::Plan {
  size_t found = 0;
  Item* existing = nullptr;
  bool probe = false;
  bool is_image = false;
  uint64_t size = 0;
  uint64_t allocated = 0;
  bool has_snapshots = false;
};

Task<Status> Catalogue::rescan(Ino dir_ino) {
  std::string rel;
  {
    std::lock_guard lk(mu_);
    auto it = dirs_.find(dir_ino);
    if (it == dirs_.end()) co_return Status::error(ENOENT, "not a catalogue directory");
    rel = it->second->rel;
  }
  const std::string dir_path = rel.empty() ? settings_.srcdir : settings_.srcdir + "/" + rel;
  struct stat dst;
  if (::stat(dir_path.c_str(), &dst) != 0) co_return Status::from_errno(errno, dir_path);
  const auto read_at = std::chrono::system_clock::now();
  auto found = read_directory(rel);
  if (!found) co_return found.status();

  // What changed: decided under the lock, probed without it.
  std::vector<Plan> plans(found->size());
  {
    std::lock_guard lk(mu_);
    Dir& d = *dirs_.at(dir_ino);
    for (size_t i = 0; i < found->size(); ++i) {
      const Found& f = (*found)[i];
      Plan& p = plans[i];
      p.found = i;
      for (Item* item : d.listing)
        if (item->file_name == f.name && same_file(item->st, f.st)) p.existing = item;
      const Item* ex = p.existing;
      if (S_ISDIR(f.st.st_mode)) continue;
      auto ni = d.not_images.find(f.name);
      if (!ex && ni != d.not_images.end() && unchanged(ni->second, f.st)) continue;  // still not an image
      p.probe = !ex || (!unchanged(ex->st, f.st) && !ex->node.file->is_open());
    }
  }
  for (Plan& p : plans) {
    if (!p.probe) continue;
    const Found& f = (*found)[p.found];
    image::ImageOptions opts = settings_.config.options_for(join_path(rel, f.name), settings_.defaults);
    Probe r = co_await probe(dir_path + "/" + f.name, f.name, std::move(opts));
    p.is_image = r.is_image;
    p.size = r.size;
    p.allocated = r.allocated;
    p.has_snapshots = r.has_snapshots;
  }

  std::lock_guard lk(mu_);
  Dir& d = *dirs_.at(dir_ino);
  std::set<std::string> taken;
  for (const Plan& p : plans)
    if (p.existing) {
      taken.insert(p.existing->node.name);
      if (p.existing->sub) taken.insert(p.existing->sub->dnode.name);
    }
  std::vector<Item*> listing;
  for (const Plan& p : plans) {
    const Found& f = (*found)[p.found];
    Item* item = p.existing;
    const bool is_dir = S_ISDIR(f.st.st_mode);
    if (p.probe && !p.is_image) {
      d.not_images[f.name] = f.st;
      continue;
    }
    if (!is_dir && !item && !p.probe) continue;  // known not to be an image
    d.not_images.erase(f.name);
    if (!item) {
      std::string name = is_dir ? f.name : raw_view_name(f.name);
      if (taken.contains(name)) name = f.name + ".raw";
      if (taken.contains(name)) {
        log::warn("{}: its view name {} is taken; not shown", join_path(rel, f.name), name);
        continue;
      }
      taken.insert(name);
      // <name>.d beside <name>.raw (the view name's stem; a directory has none).
      std::string d_name = is_dir ? std::string() : name.substr(0, name.size() - 4) + ".d";
      item = make_item(d, f, std::move(name));
      if (!d_name.empty() && taken.contains(d_name)) {
        log::warn("{}: the name {} is taken; its partitions and snapshots are not shown", join_path(rel, f.name),
                  d_name);
      } else if (!d_name.empty()) {
        taken.insert(d_name);
        make_image_dir(*item, std::move(d_name), path_of(d, f.name));
      }
    }
    // Owner and mode follow the file's own; a chmod/chown through the mount
    // holds until they change.
    if (!p.existing || f.st.st_mode != item->st.st_mode || f.st.st_uid != item->st.st_uid ||
        f.st.st_gid != item->st.st_gid) {
      const ViewAttrs a = initial_view_attrs(f.st, settings_.access);
      item->node.access->change(AccessChange{a.mode, a.uid, a.gid});
    }
    if (p.probe) {
      item->node.file->set_closed_attributes(p.size, p.allocated);
      if (item->sub) item->sub->has_snapshots = p.has_snapshots;
    }
    item->st = f.st;
    listing.push_back(item);
  }
  d.listing = std::move(listing);
  const auto mtime = std::chrono::system_clock::time_point(std::chrono::seconds(dst.st_mtim.tv_sec));
  d.read_mtime.reset();
  if (read_at - mtime > kRacyWindow) d.read_mtime = dst.st_mtim;
  co_return Status::ok();
}

Task<Status> Catalogue::refresh_name(Ino dir_ino, std::string name) {
  if (has_image_dir(dir_ino)) {
    if (image_dir_stale(dir_ino)) co_return co_await refresh_image_dir(dir_ino);
    co_return Status::ok();
  }
  auto guard = co_await refresh_mu_.lock();
  std::string rel, file_name;
  std::optional<timespec> read_mtime;
  struct stat item_st = {};
  {
    std::lock_guard lk(mu_);
    auto it = dirs_.find(dir_ino);
    if (it == dirs_.end()) co_return Status::ok();
    rel = it->second->rel;
    read_mtime = it->second->read_mtime;
    for (const Item* item : it->second->listing)
      if (item->node.name == name || (item->sub && item->sub->dnode.name == name)) {  // <name>.d: its image's
        file_name = item->file_name;
        item_st = item->st;
      }
  }
  const std::string dir_path = rel.empty() ? settings_.srcdir : settings_.srcdir + "/" + rel;
  struct stat st;
  if (!file_name.empty()) {  // a listed entry stands while its file does, whatever else changed
    if (::stat((dir_path + "/" + file_name).c_str(), &st) == 0 && unchanged(st, item_st)) co_return Status::ok();
    co_return co_await rescan(dir_ino);  // removed, renamed, replaced or rewritten in place
  }
  if (!read_mtime || ::stat(dir_path.c_str(), &st) != 0 || !same_time(st.st_mtim, *read_mtime))
    co_return co_await rescan(dir_ino);  // entries were added, removed or renamed since
  co_return Status::ok();  // no such entry, and none appeared
}

Task<std::optional<Catalogue::Clock::time_point>> Catalogue::close_idle() {
  std::optional<Clock::time_point> next;
  const auto now = Clock::now();
  for (ImageFile* f : image_files()) {
    if (!f->is_open()) continue;
    auto r = co_await f->close_if_idle(now, settings_.idle_timeout);
    if (!r) {
      log::error("closing an idle image: {}", r.status().to_string());
      continue;
    }
    if (*r && (!next || **r < *next)) next = **r;
  }
  co_return next;
}

}  // namespace qcowfs::fuse
