#include "fuse/catalogue.h"

#include <dirent.h>
#include <fcntl.h>

#include <algorithm>
#include <set>

#include "image/describe.h"
#include "image/format.h"
#include "image/probe.h"
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

}  // namespace

struct Catalogue::Found {
  std::string name;
  struct stat st = {};
};

struct Catalogue::Probe {
  bool is_image = false;
  uint64_t size = 0;
  uint64_t allocated = 0;
};

struct Catalogue::Item {
  Node node;
  std::string file_name;  // in its directory
  struct stat st = {};    // what the attributes were read from
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
  return dirs_.contains(dir);
}

const Node* Catalogue::get(Ino ino) const {
  std::lock_guard lk(mu_);
  auto it = items_.find(ino);
  return it == items_.end() ? nullptr : &it->second->node;
}

const Node* Catalogue::lookup(Ino dir, std::string_view name) const {
  std::lock_guard lk(mu_);
  auto it = dirs_.find(dir);
  if (it == dirs_.end()) return nullptr;
  for (const Item* item : it->second->listing)
    if (item->node.name == name) return &item->node;
  return nullptr;
}

std::vector<Ino> Catalogue::children(Ino dir) const {
  std::lock_guard lk(mu_);
  std::vector<Ino> out;
  auto it = dirs_.find(dir);
  if (it == dirs_.end()) return out;
  for (const Item* item : it->second->listing) out.push_back(item->node.ino);
  return out;
}

std::vector<ImageFile*> Catalogue::image_files() const {
  std::lock_guard lk(mu_);
  std::vector<ImageFile*> out;
  for (const auto& [ino, item] : items_)
    if (item->node.file) out.push_back(item->node.file.get());
  return out;
}

size_t Catalogue::open_images() const {
  size_t n = 0;
  for (ImageFile* f : image_files()) n += f->is_open() ? 1 : 0;
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
  co_return out;
}

Task<Result<std::unique_ptr<image::BlockDriver>>> Catalogue::open_view(std::string path, std::string view,
                                                                       image::ImageOptions opts) const {
  auto d = co_await image::open_image(path, std::move(opts));
  if (!d) {
    log::error("{}: cannot open {}: {}", view, path, d.status().to_string());
    co_return Status::errorf(EIO, "{}: {}", path, d.status().message());
  }
  log::debug("opened {} ({}, {})", path, (*d)->format_name(), (*d)->read_only() ? "read-only" : "read-write");
  co_return d;
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
        [this, path = path_of(dir, f.name), view = join_path(dir.rel, n.name), opts] { return open_view(path, view, opts); },
        writable);
    n.file->set_on_idle([this] {
      if (on_idle_) on_idle_();
    });
  }
  Item* raw = item.get();
  items_.emplace(raw->node.ino, std::move(item));
  return raw;
}

Task<Status> Catalogue::refresh(Ino dir) {
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
  }

  std::lock_guard lk(mu_);
  Dir& d = *dirs_.at(dir_ino);
  std::set<std::string> taken;
  for (const Plan& p : plans)
    if (p.existing) taken.insert(p.existing->node.name);
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
      item = make_item(d, f, std::move(name));
    }
    const ViewAttrs a = initial_view_attrs(f.st, settings_.access);
    item->node.access->change(AccessChange{a.mode, a.uid, a.gid});
    if (p.probe) item->node.file->set_closed_attributes(p.size, p.allocated);
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
      if (item->node.name == name) {
        file_name = item->file_name;
        item_st = item->st;
      }
  }
  const std::string dir_path = rel.empty() ? settings_.srcdir : settings_.srcdir + "/" + rel;
  struct stat st;
  if (!read_mtime || ::stat(dir_path.c_str(), &st) != 0 || !same_time(st.st_mtim, *read_mtime))
    co_return co_await rescan(dir_ino);  // entries were added, removed or renamed since
  if (file_name.empty()) co_return Status::ok();  // no such entry, and none appeared
  if (::stat((dir_path + "/" + file_name).c_str(), &st) != 0 || !unchanged(st, item_st))
    co_return co_await rescan(dir_ino);  // rewritten in place: its size may have changed
  co_return Status::ok();
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
