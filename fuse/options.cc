#include "fuse/options.h"

#include <grp.h>
#include <pwd.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <fstream>
#include <limits>
#include <optional>
#include <vector>

#include "image/crypto/secret.h"
#include "image/format.h"
#include "io/remote/canonical_url.h"
#include "io/remote/remote_options.h"

namespace qcowfs::fuse {
namespace {

// Options mount(8) and mount.fuse3 may pass that mean nothing for us.
constexpr std::array<std::string_view, 22> kIgnoredOptions = {
    "dev",  "suid",   "nodev", "nosuid", "exec",    "noexec",   "auto",
    "noauto", "user", "nouser", "users", "_netdev", "defaults", "nofail",
    // access-time flags fstab lines carry: the view's times are fixed
    "atime", "noatime", "relatime", "norelatime", "strictatime", "nodiratime", "diratime", "lazytime",
};

bool is_ignored(std::string_view opt) {
  if (opt.empty() || opt.starts_with("x-")) return true;
  return std::find(kIgnoredOptions.begin(), kIgnoredOptions.end(), opt) != kIgnoredOptions.end();
}

Status bad_value(std::string_view key, std::string_view value, std::string_view expected) {
  return Status::errorf(EINVAL, "bad value '{}' for option {} (expected {})", value, key, expected);
}

Result<unsigned> parse_queues(std::string_view value) {
  unsigned n = 0;
  auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), n);
  if (ec != std::errc() || end != value.data() + value.size() || n < 1 || n > kMaxQueues)
    return bad_value("queues", value, fmt::format("a number from 1 to {}", kMaxQueues));
  return n;
}

Result<io::EngineKind> parse_aio(std::string_view value) {
  if (value == "io_uring") return io::EngineKind::io_uring;
  if (value == "threads") return io::EngineKind::threads;
  return bad_value("aio", value, "io_uring or threads");
}

// A decimal id, or (when not a number) a name looked up with lookup(name) -> id.
template <typename Id, typename Lookup>
Result<Id> parse_id(std::string_view key, std::string_view value, std::string_view what, Lookup lookup) {
  unsigned long n = 0;
  auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), n);
  if (ec == std::errc() && end == value.data() + value.size()) {
    // (Id)-1 means "unchanged" to chown(2): not an id one can hand the view to.
    if (n >= std::numeric_limits<Id>::max()) return bad_value(key, value, fmt::format("a {} id", what));
    return static_cast<Id>(n);
  }
  if (!value.empty() && !(value[0] >= '0' && value[0] <= '9')) {
    std::optional<Id> id = lookup(std::string(value));
    if (id) return *id;
  }
  return bad_value(key, value, fmt::format("a {0} id or an existing {0} name", what));
}

std::optional<uid_t> lookup_user(const std::string& name) {
  passwd pw;
  passwd* found = nullptr;
  std::vector<char> buf(16384);
  if (::getpwnam_r(name.c_str(), &pw, buf.data(), buf.size(), &found) != 0 || !found) return std::nullopt;
  return found->pw_uid;
}

std::optional<gid_t> lookup_group(const std::string& name) {
  group gr;
  group* found = nullptr;
  std::vector<char> buf(16384);
  if (::getgrnam_r(name.c_str(), &gr, buf.data(), buf.size(), &found) != 0 || !found) return std::nullopt;
  return found->gr_gid;
}

// "5", "0.5": a duration in seconds, at most kMaxIdleTimeout, to the millisecond.
std::optional<std::chrono::milliseconds> parse_seconds(std::string_view value) {
  double seconds = 0;
  auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), seconds);
  if (ec != std::errc() || end != value.data() + value.size() || !(seconds >= 0)) return std::nullopt;
  if (seconds * 1000 > static_cast<double>(kMaxIdleTimeout.count())) return std::nullopt;
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

// An octal permission mask such as 022 or 0077 (at most 0777).
Result<mode_t> parse_mask(std::string_view key, std::string_view value) {
  unsigned n = 0;
  auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), n, 8);
  if (ec != std::errc() || end != value.data() + value.size() || value.size() > 4 || n > 0777)
    return bad_value(key, value, "an octal mask from 000 to 777, such as 022");
  return static_cast<mode_t>(n);
}

// uid=, gid=, umask=, fmask=, dmask=; false: not one of them.
Result<bool> apply_access(AccessOptions& a, std::string_view key, std::string_view value) {
  if (key == "uid") {
    auto id = parse_id<uid_t>(key, value, "user", lookup_user);
    if (!id) return id.status();
    a.uid = *id;
  } else if (key == "gid") {
    auto id = parse_id<gid_t>(key, value, "group", lookup_group);
    if (!id) return id.status();
    a.gid = *id;
  } else if (key == "umask" || key == "fmask" || key == "dmask") {
    auto mask = parse_mask(key, value);
    if (!mask) return mask.status();
    if (key != "dmask") a.fmask = *mask;
    if (key != "fmask") a.dmask = *mask;
  } else {
    return false;
  }
  return true;
}

// One branch per KEY=VALUE option, each parsing its value into its field: a
// flat list (over 40 lines) that reads like the option table it implements.
Status apply_valued(Options& o, std::string_view key, std::string_view value) {
  auto access = apply_access(o.access, key, value);
  if (!access) return access.status();
  if (*access) return Status::ok();
  auto remote = io::apply_remote_option(o.image_options.file.remote, key, value);
  if (!remote) return remote.status();
  if (*remote) return Status::ok();
  if (key == "cache") {
    auto mode = io::parse_cache_mode(value);
    if (!mode) return bad_value(key, value, "none, writethrough, writeback or unsafe");
    o.image_options.file.cache = *mode;
  } else if (key == "aio") {
    auto kind = parse_aio(value);
    if (!kind) return kind.status();
    o.aio = *kind;
  } else if (key == "queues") {
    auto n = parse_queues(value);
    if (!n) return n.status();
    o.queues = *n;
  } else if (key == "format") {
    // Formats qcowfs only recognises (vmdk, vhdx, ...) pass here: opening the
    // image refuses them with a message naming the format (image/format.h).
    if (!image::find_format(value)) return bad_value(key, value, image::supported_format_names());
    o.image_options.format = std::string(value);
  } else if (key == "discard") {
    if (value != "unmap" && value != "ignore") return bad_value(key, value, "unmap or ignore");
    o.image_options.discard_unmap = value == "unmap";
  } else if (key == "compress") {
    if (value != "on" && value != "off") return bad_value(key, value, "on or off");
    o.image_options.compress_writes = value == "on";
  } else if (key == "key-file") {
    // The passphrase of an encrypted image: the file's content, or standard input for "-".
    if (value.empty()) return bad_value(key, value, "a file holding the passphrase, or - for standard input");
    o.image_options.keys = image::crypto::KeyProvider::from_file(std::string(value));
  } else if (key == "snapshot") {
    if (value.empty()) return bad_value(key, value, "a snapshot name or id");
    o.image_options.snapshot = std::string(value);
  } else if (key == "locking") {
    auto mode = io::parse_lock_mode(value);
    if (!mode) return bad_value(key, value, "auto, on or off");
    o.image_options.file.locking = *mode;
  } else if (key == "force-share") {
    if (value != "on" && value != "off") return bad_value(key, value, "on or off");
    o.image_options.file.force_share = value == "on";
  } else if (key == "fuse_uring") {
    if (value == "auto") o.fuse_uring = FuseUringMode::automatic;
    else if (value == "on") o.fuse_uring = FuseUringMode::on;
    else if (value == "off") o.fuse_uring = FuseUringMode::off;
    else return bad_value(key, value, "auto, on or off");
  } else if (key == "passthrough") {
    if (value != "auto" && value != "off") return bad_value(key, value, "auto or off");
    o.passthrough = value == "auto";
  } else if (key == "log") {
    if (value.empty()) return bad_value(key, value, "a file to append messages to");
    o.log_file = std::string(value);
  } else if (key == "idle-timeout") {
    auto t = parse_seconds(value);
    if (!t) return bad_value(key, value, fmt::format("seconds from 0 to {}, such as 5 or 0.5", kMaxIdleTimeout.count() / 1000));
    o.idle_timeout = *t;
  } else if (key == "copy-on-read" || key == "copy_on_read") {
    if (value != "on" && value != "off") return bad_value(key, value, "on or off");
    o.image_options.copy_on_read = value == "on";
  } else if (key == "status-file") {
    if (value.empty()) return bad_value(key, value, "a file to write the remote images' statistics to");
    o.status_file = std::string(value);
  } else if (key == "l2_cache_size" || key == "table_cache_size") {
    auto size = parse_size(value);
    if (!size) return bad_value(key, value, "a size such as 4M");
    o.image_options.table_cache_size = *size;
  } else {
    return Status::errorf(EINVAL, "unknown option '{}={}'", key, value);
  }
  return Status::ok();
}

Status apply_flag(Options& o, std::string_view opt) {
  if (opt == "ro") {
    o.image_options.file.writable = false;
  } else if (opt == "rw") {
    o.image_options.file.writable = true;
  } else if (opt == "force-share") {
    o.image_options.file.force_share = true;
  } else if (opt == "throwaway") {
    o.throwaway = true;
  } else if (opt == "copy-on-read" || opt == "copy_on_read") {  // QEMU's spelling, and the issue's
    o.image_options.copy_on_read = true;
  } else if (opt == "allow_other") {
    o.allow_other = true;
  } else if (!is_ignored(opt)) {
    return Status::errorf(EINVAL, "unknown option '{}'", opt);
  }
  return Status::ok();
}

// Applies one comma-separated -o argument, left to right (later options win).
Status apply_option_list(Options& o, std::string_view list) {
  while (true) {
    size_t comma = list.find(',');
    std::string_view opt = list.substr(0, comma);
    size_t eq = opt.find('=');
    QCOWFS_TRY(eq == std::string_view::npos ? apply_flag(o, opt)
                                            : apply_valued(o, opt.substr(0, eq), opt.substr(eq + 1)));
    if (comma == std::string_view::npos) return Status::ok();
    list.remove_prefix(comma + 1);
  }
}

Status check_combination(const Options& o) {
  if (!o.image_options.snapshot.empty() && o.writable())
    return Status::errorf(EINVAL, "snapshot=NAME mounts a read-only view: it cannot be combined with {}",
                          o.throwaway ? "throwaway" : "rw");
  if (o.image_options.compress_writes && !o.writable())
    return Status::error(EINVAL, "compress=on compresses what is written: it needs rw");
  if (o.image_options.compress_writes && o.throwaway)
    return Status::error(EINVAL, "compress=on and throwaway: the writes go to a temporary overlay, not the image");
  if (!o.allow_other && o.access.uid && *o.access.uid != ::getuid())
    return Status::errorf(EINVAL,
                          "uid={} hands the view to another user, who cannot use the mount without allow_other: "
                          "add allow_other",
                          *o.access.uid);
  if (!o.allow_other && o.access.gid && *o.access.gid != ::getgid())
    return Status::errorf(EINVAL,
                          "gid={} hands the view to another group, whose members cannot use the mount without "
                          "allow_other: add allow_other",
                          *o.access.gid);
  return Status::ok();
}

}  // namespace

Result<uint64_t> parse_size(std::string_view text) {
  uint64_t n = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), n);
  if (ec != std::errc() || end == text.data()) return Status::errorf(EINVAL, "bad size '{}'", text);
  std::string_view suffix(end, static_cast<size_t>(text.data() + text.size() - end));
  unsigned shift = 0;
  if (suffix == "K" || suffix == "k") shift = 10;
  else if (suffix == "M" || suffix == "m") shift = 20;
  else if (suffix == "G" || suffix == "g") shift = 30;
  else if (suffix == "T" || suffix == "t") shift = 40;
  else if (!suffix.empty()) return Status::errorf(EINVAL, "bad size suffix in '{}' (use K, M, G or T)", text);
  if (n > (std::numeric_limits<uint64_t>::max() >> shift)) return Status::errorf(EINVAL, "size '{}' is too large", text);
  return n << shift;
}

Result<Options> parse_command_line(std::span<const std::string> args) {
  Options o;
  std::vector<std::string> positional;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "-h" || a == "--help") {
      o.help = true;
    } else if (a == "-V" || a == "--version") {
      o.version = true;
    } else if (a == "-f") {
      o.foreground = true;
    } else if (a == "-d" || a == "--debug") {
      o.debug = true;
      o.foreground = true;
    } else if (a == "-o") {
      if (i + 1 == args.size()) return Status::error(EINVAL, "option -o needs an argument");
      QCOWFS_TRY(apply_option_list(o, args[++i]));
    } else if (a.starts_with("-o")) {
      QCOWFS_TRY(apply_option_list(o, std::string_view(a).substr(2)));
    } else if (a.size() > 1 && a[0] == '-') {
      return Status::errorf(EINVAL, "unknown command-line flag '{}'", a);
    } else {
      positional.push_back(a);
    }
  }
  if (o.help || o.version) return o;
  if (positional.size() != 2)
    return Status::errorf(EINVAL, "expected IMAGE and MOUNTPOINT, got {} argument{}", positional.size(),
                          positional.size() == 1 ? "" : "s");
  o.image = positional[0];
  o.mountpoint = positional[1];
  QCOWFS_TRY(check_combination(o));
  if (o.throwaway) o.image_options.file.writable = false;  // the image is only read, whatever rw says
  return o;
}

unsigned default_queue_count() {
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  if (cpus < 1) cpus = 1;
  return std::min(static_cast<unsigned>(cpus), kMaxDefaultQueues);
}

unsigned possible_cpu_count() {
  std::ifstream in("/sys/devices/system/cpu/possible");
  std::string mask;
  std::getline(in, mask);  // e.g. "0-3" or "0,2-5"
  unsigned highest = 0;
  bool any = false;
  for (size_t i = 0; i < mask.size();) {
    unsigned v = 0;
    auto [end, ec] = std::from_chars(mask.data() + i, mask.data() + mask.size(), v);
    if (ec != std::errc()) {
      ++i;
      continue;
    }
    highest = std::max(highest, v);
    any = true;
    i = static_cast<size_t>(end - mask.data());
  }
  if (any) return highest + 1;
  long conf = sysconf(_SC_NPROCESSORS_CONF);
  return conf > 0 ? static_cast<unsigned>(conf) : 1;
}

namespace {
// The registry's format names (image/format.h), opened or only recognised.
std::string registry_names(bool supported) {
  std::string names;
  for (const image::FormatInfo& f : image::all_formats()) {
    if (f.supported() != supported) continue;
    if (!names.empty()) names += ", ";
    names += f.name;
  }
  return names;
}
}  // namespace

// The --help text: one string, as long as the option list.
std::string usage_text(std::string_view program) {
  return fmt::format(
      "usage: {0} [-f] [-d] [-o OPTION[,OPTION...]] IMAGE MOUNTPOINT\n"
      "       {0} [-f] [-d] [-o OPTION[,OPTION...]] SRCDIR MOUNTDIR\n"
      "       {0} create|info|check|map ...   (image tools: {0} COMMAND --help)\n"
      "\n"
      "Shows a disk image as one raw file: qcow2 (encrypted too), LUKS, VMDK, VHDX,\n"
      "VHD, VDI, QED, Parallels or raw. Read-only unless -o rw; read-write mounts\n"
      "write every format but streamOptimized and COWD VMDKs, differencing VHDs,\n"
      "legacy AES-encrypted qcow2 and Parallels images with a format extension.\n"
      "MOUNTPOINT may be a regular file (the raw view replaces it) or a directory\n"
      "(the view is DIR/<name>.raw, internal snapshots are\n"
      "DIR/snapshots/<snapshot>.raw, partitions DIR/partitions/).\n"
      "SRCDIR, a directory of images, shows MOUNTDIR/<name>.raw for every image in it\n"
      "(subdirectories as subdirectories), each opened on first open and closed when\n"
      "unused for idle-timeout; per-image options (rw, cache=, key-file=, format=)\n"
      "come from SRCDIR/.qcowfs.conf, lines 'PATTERN OPTION[,OPTION...]'.\n"
      "Without -f, {0} returns once the mount is up (exit 0) or has failed (exit 1,\n"
      "the reason on stderr); later messages go to syslog, or to -o log=FILE.\n"
      "\n"
      "  -f                   stay in the foreground (log to stderr)\n"
      "  -d                   debug logging and request tracing (implies -f)\n"
      "  -h, --help           show this text\n"
      "  -V, --version        show the version\n"
      "\n"
      "options (-o):\n"
      "  ro                   read-only (the default)\n"
      "  rw                   read-write\n"
      "  cache=MODE           none (O_DIRECT), writethrough, writeback (default), unsafe\n"
      "  aio=ENGINE           io_uring or threads (default: io_uring when available)\n"
      "  queues=N             event-loop threads (default: one per CPU, at most {1})\n"
      "  fuse_uring=MODE      FUSE over io_uring: auto (default: when the kernel allows),\n"
      "                       on (fail when it does not), off (/dev/fuse only)\n"
      "  passthrough=MODE     auto (default: on read-only mounts of raw images the kernel\n"
      "                       reads the image file itself when it can) or off\n"
      "  format=FMT           {2}\n"
      "                       (default: probed from the file's bytes; vhd means vpc);\n"
      "                       recognised and refused: {3}\n"
      "  key-file=PATH        the passphrase of an encrypted image (LUKS, encrypted qcow2):\n"
      "                       the file's content, - for standard input (default: asked on\n"
      "                       the terminal without echo)\n"
      "  discard=MODE         unmap (free host space on discard) or ignore (default)\n"
      "  compress=on|off      rw qcow2: store whole clusters written into unallocated\n"
      "                       space compressed (zlib or zstd, the image's type), as\n"
      "                       qemu-img convert -c would (default off)\n"
      "  snapshot=NAME        show one internal snapshot, read-only\n"
      "  throwaway            a read-write view whose writes go to a temporary overlay,\n"
      "                       dropped at unmount; the image is only read (QEMU's -snapshot;\n"
      "                       the overlay is an unnamed file in $TMPDIR, else /var/tmp)\n"
      "  l2_cache_size=SIZE   mapping table cache size (qcow2/QED L2 tables, VHDX BAT),\n"
      "                       with K/M/G suffixes; table_cache_size= is the same\n"
      "  locking=MODE         image locks as QEMU takes them: auto (default), on, off\n"
      "  force-share          read-only: share the image even with a writer (qemu-img -U)\n"
      "  copy-on-read         rw: what reads fetch from the backing chain is also\n"
      "                       written into the image (QEMU's copy-on-read=on)\n"
      "  images named by URL (http://, https://, s3://, nbd://, nbd+unix://):\n"
      "  remote-block-size=SIZE  unit of fetches and cache (default 256K)\n"
      "  remote-cache-size=SIZE  in-memory cache of fetched blocks (default 64M)\n"
      "  remote-readahead=SIZE   most read ahead of sequential reads (default 16M, 0: off)\n"
      "  remote-timeout=SECONDS  a request fails with EIO after this (default 30)\n"
      "  remote-connections=N    connections kept alive to the server (default 8)\n"
      "  remote-threads=N        http(s)/s3 network threads sharing them (default 2)\n"
      "  remote-cache-dir=DIR    keep fetched http(s)/s3 blocks in DIR across mounts\n"
      "  remote-cache-dir-size=SIZE  the most kept in DIR (default 1G)\n"
      "  sslverify=on|off     verify the server's TLS certificate (default on)\n"
      "  cafile=FILE          CA certificates to verify it with\n"
      "  header-file=FILE     extra request headers, one 'Name: value' a line\n"
      "  token-file=FILE      a bearer token sent as 'Authorization: Bearer'\n"
      "  s3-endpoint=URL      s3://BUCKET/KEY: the endpoint (default AWS); s3-region=,\n"
      "                       s3-addressing=path|virtual; keys from AWS_ACCESS_KEY_ID etc.\n"
      "                       or ~/.aws/credentials (AWS_PROFILE)\n"
      "  idle-timeout=SECONDS a directory of images: close an image this long after the\n"
      "                       last close of its view (default {4})\n"
      "  status-file=FILE     remote images' statistics as JSON, rewritten every 5 s and\n"
      "                       on SIGUSR1 (which also logs them)\n"
      "  log=FILE             once mounted, append messages (I/O errors, corruption) to\n"
      "                       FILE instead of syslog (without -f and without /dev/log\n"
      "                       they are otherwise lost)\n"
      "  allow_other          let other users access the mount (as the view's owner,\n"
      "                       group and mode allow: from the image file by default)\n"
      "  uid=USER, gid=GROUP  the view's owner and group (default: the image file's);\n"
      "                       someone other than you needs allow_other\n"
      "  umask=MASK           octal: files 0666 & ~MASK (default: the image file's\n"
      "                       rw bits), directories also limited by ~MASK\n"
      "  fmask=MASK           the same for files only\n"
      "  dmask=MASK           the same for directories only\n"
      "\n"
      "mount(8) options such as dev, suid, nodev, nosuid, exec, noexec, auto, noauto,\n"
      "user, nouser, _netdev, defaults, nofail, the atime family (atime, noatime,\n"
      "relatime, strictatime, nodiratime, lazytime, ...) and x-* are accepted and ignored.\n"
      "\n"
      "Image tools: {0} create|info|check|map ... (see {0} COMMAND --help).\n",
      program, kMaxDefaultQueues, registry_names(true), registry_names(false), kDefaultIdleTimeout.count() / 1000);
}

std::string Options::printable_image() const {
  return io::is_remote_location(image) ? io::printable_remote_location(image) : image;
}

}  // namespace qcowfs::fuse
