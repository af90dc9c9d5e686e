#include "fuse/snapshots_dir.h"

namespace qcowfs::fuse {

SnapshotDirectory::SnapshotDirectory(Ino dir, image::BlockDriver* disk)
    : ListedDirectory(dir, kSnapshotInoBase), disk_(disk) {}

SnapshotEntry* SnapshotDirectory::find_or_make(const image::SnapshotInfo& s, std::string name) {
  if (SnapshotEntry* e = find([&](const SnapshotEntry& kept) {
        return kept.info.id == s.id && kept.info.name == s.name && kept.info.disk_size == s.disk_size &&
               kept.node.name == name;
      }))
    return e;
  auto e = std::make_unique<SnapshotEntry>();
  e->info = s;
  // Opened on first open, by id; counted while open (release_view()).
  auto file = std::make_unique<ImageFile>(
      [disk = disk_, id = s.id]() -> Task<Result<std::unique_ptr<image::BlockDriver>>> {
        auto view = co_await disk->open_snapshot(id);
        if (!view) co_return view.status().with_context(fmt::format("opening snapshot {}", id));
        co_return std::move(*view);
      },
      false);
  file->set_closed_attributes(s.disk_size, 0);
  return add(std::move(e), std::move(name), std::move(file));
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
