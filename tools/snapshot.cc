// qcowfs snapshot: lists, creates, applies and deletes internal snapshots
// through the format's SnapshotOps (image/snapshot.h), with qemu-img 7.2
// snapshot's command line, listing, messages and exit codes (0, or 1 on any
// error). -l opens the image read-only (with -U, sharing it with a writer);
// -c, -a and -d open it read-write with QEMU's write lock, so an image a VM
// or a mount is using is refused. A format without internal snapshots (raw,
// vmdk, ...) answers as qemu-img does for its driver. Encrypted qcow2 images
// need no passphrase: snapshots change metadata only, which is not encrypted.
#include <sys/time.h>

#include <chrono>
#include <cstring>
#include <ctime>

#include "image/format.h"
#include "image/snapshot.h"
#include "tools/cmd.h"

namespace qcowfs::tools {
namespace {

enum class SnapshotAction { none, list, create, apply, remove };

struct SnapshotArgs : ImageCommandArgs {
  SnapshotAction action = SnapshotAction::none;
  std::string snapshot;
  bool quiet = false;
};

Result<SnapshotArgs> parse_snapshot_args(std::span<const std::string> args) {
  SnapshotArgs a;
  bool mixed = false;
  auto set_action = [&](SnapshotAction act) {
    if (a.action != SnapshotAction::none) mixed = true;
    a.action = act;
  };
  QCOWFS_TRY(parse_image_command(args, a, [&](std::span<const std::string> as, size_t& i) -> Result<bool> {
    std::string v;
    if (as[i] == "-q" || as[i] == "--quiet") return a.quiet = true;
    if (as[i] == "-l") {
      set_action(SnapshotAction::list);
      return true;
    }
    if (as[i] == "--json" || as[i].starts_with("--output")) return Status::errorf(EINVAL, "unknown option '{}'", as[i]);
    for (auto [flag, act] : {std::pair{"-c", SnapshotAction::create}, std::pair{"-a", SnapshotAction::apply},
                             std::pair{"-d", SnapshotAction::remove}}) {
      if (!as[i].starts_with(flag)) continue;
      if (!take_option(as, i, "", flag, v)) return Status::errorf(EINVAL, "option '{}' requires an argument", flag);
      set_action(act);
      a.snapshot = v;
      return true;
    }
    return false;
  }));
  if (mixed) return Status::error(EINVAL, "Cannot mix '-l', '-a', '-c', '-d'");
  return a;
}

// QEMU's bdrv_snapshot_dump(): "%-9s %-16s %8s%20s%13s%11s".
std::string snapshot_row(const image::SnapshotEntry& e) {
  const image::SnapshotInfo& s = e.info;
  std::time_t t = static_cast<std::time_t>(s.date_sec);
  std::tm tm{};
  ::localtime_r(&t, &tm);
  char date[64];
  std::strftime(date, sizeof date, "%Y-%m-%d %H:%M:%S", &tm);
  const uint64_t secs = s.vm_clock_ns / 1000000000;
  std::string clock = fmt::format("{:02}:{:02}:{:02}.{:03}", secs / 3600, (secs / 60) % 60, secs % 60,
                                  (s.vm_clock_ns / 1000000) % 1000);
  std::string icount = e.icount ? fmt::format("{}", static_cast<int64_t>(*e.icount)) : "";
  return fmt::format("{:<9} {:<16} {:>8}{:>20}{:>13}{:>11}", s.id, s.name, human_size(s.vm_state_size), date, clock,
                     icount);
}

void print_snapshot_list(const std::vector<image::SnapshotEntry>& list) {
  if (list.empty()) return;  // qemu-img prints nothing at all then
  fmt::print("Snapshot list:\n{:<10}{:<17}{:>8}{:>20}{:>13}{:>11}\n", "ID", "TAG", "VM SIZE", "DATE", "VM CLOCK",
             "ICOUNT");
  for (const auto& s : list) fmt::print("{}\n", snapshot_row(s));
}

// A status's text where QEMU prints strerror(): the detail, if any, after it.
std::string errno_detail(const Status& st) {
  std::string text = std::strerror(st.code());
  if (!st.message().empty() && st.message() != text) text += ": " + st.message();
  return text;
}

image::NewSnapshot new_snapshot(const std::string& name) {
  // qemu-img: seconds and microseconds of gettimeofday().
  auto now = std::chrono::system_clock::now().time_since_epoch();
  auto usec = std::chrono::duration_cast<std::chrono::microseconds>(now).count();
  image::NewSnapshot n;
  n.name = name;
  n.date_sec = static_cast<uint32_t>(usec / 1000000);
  n.date_nsec = static_cast<uint32_t>(usec % 1000000 * 1000);
  return n;
}

// The action on an opened image; messages as qemu-img's img_snapshot().
Task<Status> run_action(const SnapshotArgs& a, io::HostFile& file, const image::SnapshotOps* ops) {
  const std::string& name = a.snapshot;
  switch (a.action) {
    case SnapshotAction::none:
      co_return Status::ok();
    case SnapshotAction::list: {
      if (!ops) co_return Status::ok();
      auto list = co_await ops->list(file);
      if (!list) co_return list.status();
      print_snapshot_list(*list);
      co_return Status::ok();
    }
    case SnapshotAction::create: {
      Status st = Status::error(ENOTSUP, "");
      if (ops) st = (co_await ops->create(file, new_snapshot(name))).status();
      if (st) co_return st;
      co_return Status::errorf(st.code(), "Could not create snapshot '{}': -{} ({})", name, st.code(), errno_detail(st));
    }
    case SnapshotAction::apply: {
      if (!ops) co_return Status::errorf(ENOTSUP, "Could not apply snapshot '{}': Block driver does not support snapshots", name);
      Status st = co_await ops->apply(file, name);
      if (st) co_return st;
      if (st.code() == EBUSY) co_return Status::errorf(EBUSY, "Could not apply snapshot '{}': {}", name, st.to_string());
      co_return Status::errorf(st.code(), "Could not apply snapshot '{}': Failed to load snapshot: {}", name, errno_detail(st));
    }
    case SnapshotAction::remove: {
      // qemu-img finds the snapshot by name (bdrv_snapshot_find()), then
      // deletes the one with that entry's ID and name.
      Result<std::vector<image::SnapshotEntry>> list = std::vector<image::SnapshotEntry>{};
      if (ops) list = co_await ops->list(file);
      if (!list) co_return Status::errorf(list.status().code(), "Could not delete snapshot '{}': {}", name, list.status().to_string());
      const image::SnapshotInfo* found = nullptr;
      for (const auto& e : *list)
        if (!found && e.info.name == name) found = &e.info;
      if (!found) co_return Status::errorf(ENOENT, "Could not delete snapshot '{}': snapshot not found", name);
      Status st = co_await ops->remove(file, found->id, found->name);
      if (st) co_return st;
      co_return Status::errorf(st.code(), "Could not delete snapshot '{}': {}", name, st.to_string());
    }
  }
  co_return Status::ok();
}

Task<Status> snapshot(const SnapshotArgs& a) {
  const bool list = a.action == SnapshotAction::list;
  if (a.force_share && !list)
    co_return Status::errorf(EINVAL, "Could not open '{}': force-share=on can only be used with read-only images", a.image);
  io::OpenOptions o = a.read_options();
  o.writable = !list;
  auto image = co_await open_image_file(a.image, o, a.format, "");
  if (!image) co_return image.status();
  const image::FormatInfo* format = image::find_format(image->format);
  Status st = co_await run_action(a, *image->file, format ? format->snapshot : nullptr);
  if (st && image->file->writable()) st = co_await image->file->flush();
  co_return st;
}

}  // namespace

std::string_view snapshot_usage() {
  return "usage: qcowfs snapshot [-U] [-q] [-f FORMAT] [--key-file PATH] (-l | -c NAME | -a NAME | -d NAME) IMAGE\n"
         "\n"
         "Lists, creates, applies or deletes internal snapshots of a qcow2 image, like\n"
         "qemu-img snapshot (same listing, messages and exit status: 0, or 1 on error).\n"
         "The image is opened read-write with QEMU's locks (read-only for -l), so an image\n"
         "a VM or a mount is using is refused. Encrypted images need no passphrase.\n"
         "\n"
         "  -l                   list the snapshots\n"
         "  -c NAME              create a snapshot of the disk as it is now\n"
         "  -a NAME              apply snapshot NAME (an ID or a name): the disk becomes\n"
         "                       what it was then, its size included\n"
         "  -d NAME              delete the snapshot named NAME and free what only it used\n"
         "  -f, --format=FMT     image format (default: probed)\n"
         "  --key-file=PATH      accepted for symmetry with the other commands (unused)\n"
         "  -U, --force-share    list the snapshots of an image another process is writing\n"
         "                       (-l only)\n"
         "  -q, --quiet          print nothing but errors\n"
         "  -h, --help           show this text\n";
}

int cmd_snapshot(std::span<const std::string> args) {
  return run_tool("snapshot", snapshot_usage(), parse_snapshot_args(args), [](const SnapshotArgs& a, io::Engine& engine) {
    Status st = io::run_sync(engine, snapshot(a));
    return st ? 0 : cmd_fail("snapshot", st);
  });
}

}  // namespace qcowfs::tools
