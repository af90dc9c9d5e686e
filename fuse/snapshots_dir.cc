#include "fuse/snapshots_dir.h"

namespace qcowfs::fuse {

SnapshotDirectory::SnapshotDirectory(Ino dir, image::BlockDriver* disk) : dir_(dir), disk_(disk) {}

const Node* SnapshotDirectory::get(Ino ino) const {
  std::lock_guard lk(mu_);
  auto it = all_.find(ino);
  return it == all_.end() ? nullptr : &it->second->node;
}

const Node* SnapshotDirectory::lookup(Ino, std::string_view name) const {
  std::lock_guard lk(mu_);
  for (const Entry* e : current_)
    if (e->node.name == name) return &e->node;
  return nullptr;
}

std::vector<Ino> SnapshotDirectory::children(Ino) const {
  std::lock_guard lk(mu_);
  std::vector<Ino> out;
  for (const Entry* e : current_) out.push_back(e->node.ino);
  return out;
}

std::vector<ImageFile*> SnapshotDirectory::image_files() const {
  std::lock_guard lk(mu_);
  std::vector<ImageFile*> out;
  for (const auto& [ino, e] : all_) out.push_back(e->node.file.get());
  return out;
}

SnapshotDirectory::Entry* SnapshotDirectory::find_or_make(const image::SnapshotInfo& s, std::string name) {
  for (auto& [ino, e] : all_)
    if (e->info.id == s.id && e->info.name == s.name && e->info.disk_size == s.disk_size && e->node.name == name)
      return e.get();
  auto e = std::make_unique<Entry>();
  e->info = s;
  e->node.ino = next_ino_++;
  e->node.parent = dir_;
  e->node.kind = NodeKind::image;
  e->node.name = std::move(name);
  // Opened on first open, by id; counted while open (release_view()).
  e->node.file = std::make_unique<ImageFile>(
      [disk = disk_, id = s.id]() -> Task<Result<std::unique_ptr<image::BlockDriver>>> {
        auto view = co_await disk->open_snapshot(id);
        if (!view) co_return view.status().with_context(fmt::format("opening snapshot {}", id));
        co_return std::move(*view);
      },
      false);
  e->node.file->set_closed_attributes(s.disk_size, 0);
  Entry* raw = e.get();
  all_.emplace(raw->node.ino, std::move(e));
  return raw;
}

void SnapshotDirectory::reread() {
  const std::vector<image::SnapshotInfo> snaps = disk_->snapshots();
  std::lock_guard lk(mu_);
  current_.clear();
  std::vector<std::string> taken;
  for (const image::SnapshotInfo& s : snaps) {
    std::string name = snapshot_file_name(s.name, s.id, taken);
    taken.push_back(name);
    current_.push_back(find_or_make(s, std::move(name)));
  }
}

Task<Status> SnapshotDirectory::refresh(Ino) {
  reread();
  co_return Status::ok();
}

Task<Status> SnapshotDirectory::release_view(std::string id) {
  std::vector<ImageFile*> views;
  {
    std::lock_guard lk(mu_);
    for (const auto& [ino, e] : all_)
      if (e->info.id == id) views.push_back(e->node.file.get());
  }
  for (ImageFile* v : views) {
    // Never waits: an open under way waits for the paused driver.
    auto closed = co_await v->close_if_unused();
    if (!closed) co_return closed.status();
    if (!*closed) co_return Status::errorf(EBUSY, "snapshot {} is open", id);
  }
  co_return Status::ok();
}

SnapshotDirectory* add_snapshot_directory(InodeTable& table, image::BlockDriver& disk, bool may_change) {
  if (!may_change && disk.snapshots().empty()) return nullptr;
  Ino dir = table.add_directory(kRootIno, "snapshots");
  auto d = std::make_unique<SnapshotDirectory>(dir, &disk);
  d->reread();
  SnapshotDirectory* raw = d.get();
  table.set_dynamic(std::move(d));
  return raw;
}

}  // namespace qcowfs::fuse
