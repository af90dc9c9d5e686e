// Command-line parsing for the qcowfs binary, following FUSE conventions so
// that `mount -t fuse.qcowfs IMAGE DIR -o OPTS` and fstab entries work:
//
//   qcowfs [-f] [-d] [-o OPT[,OPT...]] IMAGE MOUNTPOINT
//   qcowfs [-f] [-d] [-o OPT[,OPT...]] SRCDIR MOUNTPOINT   (a directory of images)
//
// Options may appear before or after the two positional arguments (mount.fuse3
// puts them last). Unknown options and bad values are errors with a message
// naming the culprit. Nothing here touches the system, except that uid=/gid=
// given as names are looked up in the user and group databases, and the
// mounting user's ids are read to check them against allow_other.
// Thread-safety: functions on values (the look-ups use the reentrant calls).
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "fuse/access.h"
#include "image/block_driver.h"
#include "io/engine.h"
#include "io/host_file.h"
#include "io/status.h"

namespace qcowfs::fuse {

// Most event-loop threads picked by default (one per CPU up to this).
constexpr unsigned kMaxDefaultQueues = 4;
constexpr unsigned kMaxQueues = 64;

// fuse_uring=: FUSE over io_uring (Linux 6.14+ with fuse.enable_uring=Y).
enum class FuseUringMode { automatic, on, off };

// How long a catalogue keeps an unused image open (idle-timeout=), and the most one may ask.
constexpr std::chrono::milliseconds kDefaultIdleTimeout{5000};
constexpr std::chrono::milliseconds kMaxIdleTimeout{86'400'000};

struct Options {
  std::string image;
  // The image as logs, messages and the mount table show it: a URL without
  // its password and query (io::printable_remote_location).
  std::string printable_image() const;
  std::string mountpoint;
  bool foreground = false;  // -f (and implied by -d)
  bool debug = false;       // -d: debug logging, libfuse request tracing
  bool help = false;
  bool version = false;

  // How the image is opened: format=, ro (default) / rw, cache=, locking=,
  // force-share, discard=, compress=, snapshot=, l2_cache_size= or table_cache_size= (image/block_driver.h).
  image::ImageOptions image_options;
  // throwaway (QEMU's -snapshot, a name that does not collide with
  // snapshot=NAME): the image opened read-only (image_options.file.writable
  // false, its shared read lock) under a temporary overlay that takes the
  // view's writes and is dropped at unmount (image/views/throwaway.h).
  bool throwaway = false;
  // Whether the view takes writes: rw, or throwaway.
  bool writable() const { return image_options.file.writable || throwaway; }

  io::EngineKind aio = io::EngineKind::automatic;
  unsigned queues = 0;  // 0: default_queue_count()
  bool allow_other = false;
  // uid=, gid=, umask=, fmask=, dmask=: the view's owner and permission bits
  // (default: the image file's); uid/gid naming someone else need allow_other.
  AccessOptions access;
  FuseUringMode fuse_uring = FuseUringMode::automatic;
  // passthrough=auto|off: let the kernel serve read-only opens of a raw image
  // straight from the host file (FUSE passthrough, Linux 6.9+, as root).
  bool passthrough = true;
  // log=FILE: once mounted, messages are appended to FILE (instead of syslog
  // or stderr); opened before daemonizing, so a bad path fails the mount.
  std::string log_file;
  // idle-timeout=SECONDS: a directory of images (catalogue mount) closes an
  // image this long after the last close of its view.
  std::chrono::milliseconds idle_timeout{kDefaultIdleTimeout};
  // status-file=PATH: the remote images' statistics as JSON, rewritten at
  // mount, on SIGUSR1 and every few seconds (fuse/remote_status.h).
  std::string status_file;
};

// Parses argv without the program name. --help and --version set their flags
// and skip the positional-argument check.
Result<Options> parse_command_line(std::span<const std::string> args);

// "64K", "1M", "2g", "4096" -> bytes (K/M/G/T are binary multiples).
Result<uint64_t> parse_size(std::string_view text);

// One event-loop thread per CPU, at most kMaxDefaultQueues.
unsigned default_queue_count();

// The number of FUSE-over-io_uring queues the kernel keeps: one per possible
// CPU (the highest CPU number in /sys/devices/system/cpu/possible, plus one).
unsigned possible_cpu_count();

std::string usage_text(std::string_view program);

}  // namespace qcowfs::fuse
