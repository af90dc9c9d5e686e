#include "fuse/partitions_dir.h"

#include <algorithm>

#include "io/log.h"
#include "io/run_sync.h"

namespace qcowfs::fuse {

PartitionDirectory::PartitionDirectory(Ino dir, image::BlockDriver* disk, bool writable)
    : ListedDirectory(dir, kPartitionInoBase), disk_(disk), writable_(writable) {}

PartitionEntry* PartitionDirectory::find_or_make(const image::Partition& p) {
  if (PartitionEntry* e = find([&p](const PartitionEntry& kept) {
        return kept.partition.number == p.number && kept.partition.offset == p.offset &&
               kept.partition.size == p.size;
      }))
    return e;
  auto e = std::make_unique<PartitionEntry>();
  e->partition = p;
  e->window = std::make_unique<image::WindowDriver>(disk_, p.offset, p.size);
  auto file = std::make_unique<ImageFile>(e->window.get(), writable_);
  file->watch_writes(this, p.offset);
  return add(std::move(e), fmt::format("p{}.raw", p.number), std::move(file));
}

Task<Status> PartitionDirectory::refresh(Ino) {
  // Cleared before reading: a write that lands while the table is read marks it again.
  stale_.store(false, std::memory_order_release);
  auto table = co_await image::read_partition_table(*disk_);
  if (!table) {
    stale_.store(true, std::memory_order_release);
    co_return table.status();
  }
  std::lock_guard lk(mu_);
  current_.clear();
  for (const image::Partition& p : table->partitions) current_.push_back(find_or_make(p));
  set_watched(std::move(table->read_from));
  co_return Status::ok();
}

void PartitionDirectory::set_watched(Ranges ranges) {
  std::sort(ranges.begin(), ranges.end(),
            [](const image::DiskRange& a, const image::DiskRange& b) { return a.offset < b.offset; });
  const Ranges* now = watched_.load(std::memory_order_relaxed);
  auto same = [](const image::DiskRange& a, const image::DiskRange& b) {
    return a.offset == b.offset && a.length == b.length;
  };
  if (now && std::equal(now->begin(), now->end(), ranges.begin(), ranges.end(), same)) return;
  watched_lists_.push_back(std::make_unique<const Ranges>(std::move(ranges)));
  watched_.store(watched_lists_.back().get(), std::memory_order_release);
}

bool PartitionDirectory::watched(uint64_t disk_offset, uint64_t len) const {
  if (disk_offset < kWatchedHead) return true;
  const Ranges* ranges = watched_.load(std::memory_order_acquire);
  if (!ranges) return false;
  const uint64_t end = disk_offset + len;  // inside the disk: no overflow
  for (const image::DiskRange& r : *ranges) {
    if (r.offset >= end) break;  // sorted: the rest start later
    if (r.offset + r.length > disk_offset) return true;
  }
  return false;
}

void PartitionDirectory::note_write(uint64_t disk_offset, uint64_t len) {
  if (len == 0 || stale_.load(std::memory_order_relaxed)) return;  // already marked: no scan, no store
  if (watched(disk_offset, len)) stale_.store(true, std::memory_order_release);
}

void add_partition_directory(InodeTable& table, ImageFile& disk_view, io::Engine& engine) {
  Ino dir = table.add_directory(kRootIno, "partitions");
  auto d = std::make_unique<PartitionDirectory>(dir, disk_view.driver(), disk_view.writable());
  disk_view.watch_writes(d.get(), 0);
  Status st = io::run_sync(engine, d->refresh(dir));
  if (!st) log::warn("reading the partition table: {}", st.to_string());
  table.set_dynamic(std::move(d));
}

}  // namespace qcowfs::fuse
