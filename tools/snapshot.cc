// qcowfs snapshot: lists, creates, applies and deletes internal snapshots
// through the format's SnapshotOps (image/snapshot.h), with qemu-img 7.2
// snapshot's command line, listing, messages and exit codes (0, or 1 on any
// error). When a qcowfs mount holds the image, its daemon is asked through its
// control socket (io/control_socket.h, fuse/live_snapshot.h) and does the
// operation live. Otherwise -l opens the image read-only (with -U, sharing it
// with a writer, never asking a daemon); -c, -a and -d open it read-write
// with QEMU's write lock, so an image a VM is using is refused. A format
// without internal snapshots (raw, vmdk, ...) answers as qemu-img does for its
// driver. Encrypted qcow2 images
// need no passphrase: snapshots change metadata only, which is not encrypted.
#include <mntent.h>
#include <sys/stat.h>
#include <sys/time.h>

#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <optional>
#include <vector>

#include <unistd.h>

#include "image/format.h"
#include "image/snapshot.h"
#include "image/snapshot_control.h"
#include "io/control_socket.h"
#include "tools/cmd.h"

namespace qcowfs::tools {
namespace {

enum class SnapshotAction { none, list, create, apply, remove, external };

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
    if (as[i].starts_with("--external")) {
      if (!take_option(as, i, "--external", "", v))
        return Status::error(EINVAL, "option '--external' requires an argument");
      set_action(SnapshotAction::external);
      a.snapshot = v;
      return true;
    }
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

// Where the operations run: on the image file (offline), or in the qcowfs
// daemon that holds the image, through its control socket (live).
class SnapshotTarget {
 public:
  virtual ~SnapshotTarget() = default;
  virtual bool supported() const = 0;  // false: the format has no internal snapshots
  virtual Task<Result<std::vector<image::SnapshotEntry>>> list() = 0;
  virtual Task<Result<image::SnapshotEntry>> create(image::NewSnapshot snapshot) = 0;
  virtual Task<Status> apply(std::string id_or_name) = 0;
  virtual Task<Status> remove(std::string id, std::string name) = 0;
};

class OfflineTarget final : public SnapshotTarget {
 public:
  OfflineTarget(io::HostFile& file, const image::SnapshotOps* ops) : file_(file), ops_(ops) {}
  bool supported() const override { return ops_ != nullptr; }
  Task<Result<std::vector<image::SnapshotEntry>>> list() override { return ops_->list(file_); }
  Task<Result<image::SnapshotEntry>> create(image::NewSnapshot s) override { return ops_->create(file_, std::move(s)); }
  Task<Status> apply(std::string id_or_name) override { return ops_->apply(file_, std::move(id_or_name)); }
  Task<Status> remove(std::string id, std::string name) override {
    return ops_->remove(file_, std::move(id), std::move(name));
  }

 private:
  io::HostFile& file_;
  const image::SnapshotOps* ops_;
};

// A daemon's answer may take a while (it writes back its caches, then the
// snapshot); a daemon that gives none within this is taken for stuck.
constexpr auto kLiveReplyTimeout = std::chrono::minutes(5);

// One request per connection (io/control_socket.h, image/snapshot_control.h).
class LiveTarget final : public SnapshotTarget {
 public:
  explicit LiveTarget(std::string socket) : socket_(std::move(socket)) {}
  bool supported() const override { return true; }  // the daemon answers for its format
  Task<Result<std::vector<image::SnapshotEntry>>> list() override {
    auto reply = ask({image::ControlOp::list, "", ""});
    if (!reply) co_return reply.status();
    co_return std::move(reply->snapshots);
  }
  Task<Result<image::SnapshotEntry>> create(image::NewSnapshot s) override {
    auto reply = ask({image::ControlOp::create, "", s.name});
    if (!reply) co_return reply.status();
    if (reply->snapshots.empty()) co_return Status::error(EPROTO, "the daemon's reply names no snapshot");
    co_return std::move(reply->snapshots.front());
  }
  Task<Status> apply(std::string id_or_name) override {
    co_return ask({image::ControlOp::apply, "", std::move(id_or_name)}).status();
  }
  Task<Status> remove(std::string id, std::string name) override {
    co_return ask({image::ControlOp::remove, std::move(id), std::move(name)}).status();
  }
  Status external(std::string overlay) const {
    return ask({image::ControlOp::external, "", std::move(overlay)}).status();
  }

 private:
  // The reply, or its status as the error (the daemon's, or the socket's).
  Result<image::ControlReply> ask(const image::ControlRequest& request) const {
    auto fd = io::connect_control(socket_);
    if (!fd) return fd.status();
    const auto deadline = io::ControlClock::now() + kLiveReplyTimeout;
    // A daemon that refuses the peer (SO_PEERCRED) replies and closes before
    // reading: the send may then fail (EPIPE) with the refusal already waiting
    // to be read, so the reply is read either way and wins over the send error.
    Status sent = io::write_control_text(fd->get(), image::encode_request(request) + "\n", deadline);
    auto line = io::read_control_line(fd->get(), deadline, 16u << 20);
    if (!line && !sent) return sent;
    if (!line) return line.status().with_context(fmt::format("the qcowfs daemon at {}", socket_));
    auto reply = image::decode_reply(*line);
    if (!reply) return reply.status();
    if (!reply->status) return reply->status;
    return reply;
  }
  std::string socket_;
};

// The action on a target; messages as qemu-img's img_snapshot().
Task<Status> run_action(const SnapshotArgs& a, SnapshotTarget& target) {
  const std::string& name = a.snapshot;
  switch (a.action) {
    case SnapshotAction::none:
    case SnapshotAction::external:  // external_snapshot()
      co_return Status::ok();
    case SnapshotAction::list: {
      if (!target.supported()) co_return Status::ok();
      auto list = co_await target.list();
      if (!list) co_return list.status();
      print_snapshot_list(*list);
      co_return Status::ok();
    }
    case SnapshotAction::create: {
      Status st = Status::error(ENOTSUP, "");
      if (target.supported()) st = (co_await target.create(new_snapshot(name))).status();
      if (st) co_return st;
      co_return Status::errorf(st.code(), "Could not create snapshot '{}': -{} ({})", name, st.code(), errno_detail(st));
    }
    case SnapshotAction::apply: {
      if (!target.supported()) co_return Status::errorf(ENOTSUP, "Could not apply snapshot '{}': Block driver does not support snapshots", name);
      Status st = co_await target.apply(name);
      if (st) co_return st;
      if (st.code() == EBUSY) co_return Status::errorf(EBUSY, "Could not apply snapshot '{}': {}", name, st.to_string());
      co_return Status::errorf(st.code(), "Could not apply snapshot '{}': Failed to load snapshot: {}", name, errno_detail(st));
    }
    case SnapshotAction::remove: {
      // qemu-img finds the snapshot by name (bdrv_snapshot_find()), then
      // deletes the one with that entry's ID and name.
      Result<std::vector<image::SnapshotEntry>> list = std::vector<image::SnapshotEntry>{};
      if (target.supported()) list = co_await target.list();
      if (!list) co_return Status::errorf(list.status().code(), "Could not delete snapshot '{}': {}", name, list.status().to_string());
      const image::SnapshotInfo* found = nullptr;
      for (const auto& e : *list)
        if (!found && e.info.name == name) found = &e.info;
      if (!found) co_return Status::errorf(ENOENT, "Could not delete snapshot '{}': snapshot not found", name);
      Status st = co_await target.remove(found->id, found->name);
      if (st) co_return st;
      co_return Status::errorf(st.code(), "Could not delete snapshot '{}': {}", name, st.to_string());
    }
  }
  co_return Status::ok();
}

// The control socket of a qcowfs daemon holding the image, if one answers.
// Sockets left by a daemon that is gone (connection refused) are removed
// when we may and skipped; `denied` collects the ones we may not use.
std::optional<std::string> find_live_daemon(const std::string& image, std::vector<std::string>& denied) {
  auto candidates = io::control_socket_candidates(image);
  if (!candidates) return std::nullopt;  // the offline open says why
  for (const std::string& path : *candidates) {
    auto fd = io::connect_control(path);
    if (fd) return path;
    const int err = fd.status().code();
    if (err == ECONNREFUSED) ::unlink(path.c_str());
    else if (err == EACCES || err == EPERM) denied.push_back(path);
  }
  return std::nullopt;
}

// When IMAGE is locked and no daemon answered: the catalogue mount (`qcowfs
// SRCDIR MOUNTDIR`, a fuse.qcowfs mount whose source is a directory) whose
// SRCDIR holds IMAGE, if any. Such a mount holds an image open (and locked)
// while a view of it is in use and for its idle delay after, with a control
// socket; this is reached only when it could not make one (it logged why).
std::optional<std::string> catalogue_holding(const std::string& image) {
  std::error_code ec;
  const std::filesystem::path file = std::filesystem::weakly_canonical(image, ec);
  if (ec) return std::nullopt;
  FILE* mounts = ::setmntent("/proc/self/mounts", "r");
  if (!mounts) return std::nullopt;
  std::optional<std::string> found;
  mntent entry;
  char buf[4096];
  while (!found && ::getmntent_r(mounts, &entry, buf, sizeof buf)) {
    if (std::string_view(entry.mnt_type) != "fuse.qcowfs") continue;
    struct stat st {};
    if (::stat(entry.mnt_fsname, &st) != 0 || !S_ISDIR(st.st_mode)) continue;
    const std::filesystem::path srcdir = std::filesystem::weakly_canonical(entry.mnt_fsname, ec);
    if (ec) continue;
    auto rel = file.lexically_relative(srcdir);
    if (rel.empty() || rel.native().starts_with("..")) continue;
    found = fmt::format(
        "the qcowfs catalogue mount of {} on {} holds it open while a view of it is in use and for its idle-timeout "
        "after, without a control socket for it (see that mount's log): close its views, then retry",
        srcdir.string(), entry.mnt_dir);
  }
  ::endmntent(mounts);
  return found;
}

// --external NEW: only a mount can switch to a new overlay (offline, that is
// `qcowfs create -f qcow2 -b IMAGE -F FMT NEW`).
Status external_snapshot(const SnapshotArgs& a, std::vector<std::string>& denied) {
  std::error_code ec;
  const std::string overlay = std::filesystem::absolute(a.snapshot, ec).lexically_normal().string();
  if (ec) return Status::from_errno(ec.value(), a.snapshot);
  auto live_socket = find_live_daemon(a.image, denied);
  if (!live_socket) {
    std::string why = denied.empty() ? "no qcowfs mount holds it"
                                     : fmt::format("its mount's control socket {} is not open to this user "
                                                   "(only the mount's owner and root)", denied.front());
    return Status::errorf(ENOENT,
                          "Could not create external snapshot '{}' of '{}': {}; for an image nobody uses, "
                          "qcowfs create -f qcow2 -b IMAGE -F FORMAT NEW_OVERLAY",
                          overlay, a.image, why);
  }
  Status st = LiveTarget(*live_socket).external(overlay);
  if (st) return st;
  return Status::errorf(st.code(), "Could not create external snapshot '{}': {}", overlay, st.to_string());
}

Task<Status> snapshot(const SnapshotArgs& a) {
  const bool list = a.action == SnapshotAction::list;
  if (a.force_share && !list)
    co_return Status::errorf(EINVAL, "Could not open '{}': force-share=on can only be used with read-only images", a.image);
  std::vector<std::string> denied;
  if (a.action == SnapshotAction::external) co_return external_snapshot(a, denied);
  if (!a.force_share) {
    if (auto live_socket = find_live_daemon(a.image, denied)) {
      LiveTarget live(*live_socket);
      co_return co_await run_action(a, live);
    }
  }
  io::OpenOptions o = a.read_options();
  o.writable = !list;
  auto image = co_await open_image_file(a.image, o, a.format, "");
  if (!image && !denied.empty())
    co_return Status::errorf(image.status().code(),
                             "{}; a qcowfs mount of another user may hold it (its control socket {} is not open to "
                             "this user): only the mount's owner and root may take its snapshots",
                             image.status().to_string(), denied.front());
  if (!image && image.status().code() == EBUSY)
    if (auto holder = catalogue_holding(a.image))
      co_return Status::errorf(EBUSY, "{}; {}", image.status().to_string(), *holder);
  if (!image) co_return image.status();
  const image::FormatInfo* format = image::find_format(image->format);
  OfflineTarget offline(*image->file, format ? format->snapshot : nullptr);
  Status st = co_await run_action(a, offline);
  if (st && image->file->writable()) st = co_await image->file->flush();
  co_return st;
}

}  // namespace

std::string_view snapshot_usage() {
  return "usage: qcowfs snapshot [-U] [-q] [-f FORMAT] [--key-file PATH] (-l | -c NAME | -a NAME | -d NAME) IMAGE\n"
         "       qcowfs snapshot --external NEW_OVERLAY IMAGE\n"
         "\n"
         "Lists, creates, applies or deletes internal snapshots of a qcow2 image, like\n"
         "qemu-img snapshot (same listing, messages and exit status: 0, or 1 on error).\n"
         "When a qcowfs mount holds IMAGE, its daemon does it live over the mount's\n"
         "control socket (the mount's owner and root only): -c waits for the writes in\n"
         "flight and holds new ones for the moment it takes; -a is refused while mounted.\n"
         "Otherwise the image is opened read-write with QEMU's locks (read-only for -l),\n"
         "so an image a VM is using is refused. Encrypted images need no passphrase.\n"
         "\n"
         "  -l                   list the snapshots\n"
         "  -c NAME              create a snapshot of the disk as it is now\n"
         "  -a NAME              apply snapshot NAME (an ID or a name): the disk becomes\n"
         "                       what it was then, its size included\n"
         "  -d NAME              delete the snapshot named NAME and free what only it used\n"
         "  --external=NEW_OVERLAY\n"
         "                       (a mounted IMAGE only) switch the mount to a new qcow2\n"
         "                       overlay NEW_OVERLAY over IMAGE, which stays as it is now,\n"
         "                       read-only: copy or check it while the mount goes on\n"
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
