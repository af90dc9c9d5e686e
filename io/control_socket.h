// The control socket of a qcowfs mount: a unix stream socket through which
// `qcowfs snapshot` asks the daemon holding an image to act on it (live
// snapshots, fuse/live_snapshot.h). This file is the host side both ends
// share: where the socket of an image lives, listening, accepting with the
// peer's credentials, connecting, and reading or writing one line within a
// deadline. What the lines say is image/snapshot_control.h's.
//
// Where: one socket per image file, named after the file's (st_dev, st_ino)
// (`<dev>-<ino>.sock`, hex), so a client finds it from the image's path alone
// whatever path the mount was given. The directory is /run/qcowfs for root and
// $XDG_RUNTIME_DIR/qcowfs (else /run/user/UID/qcowfs) for other users; it is
// made 0700 and the socket 0600, and the daemon also checks every peer's
// SO_PEERCRED uid (the mount's owner or root only).
//
// A URL (io::is_remote_location) has no (st_dev, st_ino): its socket is
// `url-<hex>.sock`, 128 bits of the SHA-256 of the URL's canonical form
// (io/remote/canonical_url.h), so a client finds the daemon when it names the
// URL as the mount did or in an equivalent spelling (upper-case host, default
// port, dot segments...; fuse/DESIGN.md).
//
// A socket file whose daemon is gone refuses connections (ECONNREFUSED): a
// listener replaces it, a client removes it if it may and carries on as if
// there were none.
//
// Thread-safety: plain functions and move-only values; a ControlListener
// belongs to one thread.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "io/fd.h"
#include "io/status.h"

namespace qcowfs::io {

using ControlClock = std::chrono::steady_clock;

// The directory of uid's control sockets ("" when a non-root user has no
// runtime directory).
std::string control_directory(uid_t uid);
// The socket's file name for the image file at path (stat follows links;
// errors as stat's), or for a URL.
Result<std::string> control_socket_name(const std::string& image_path);
// Every path where a daemon serving the image at image_path may listen, for a
// client running as the current user: its own directory first, then root's,
// and for root also every user's (/run/user/*/qcowfs).
Result<std::vector<std::string>> control_socket_candidates(const std::string& image_path);

// An accepted connection and who is at the other end.
struct ControlPeer {
  UniqueFd fd;
  uid_t uid = 0;
  pid_t pid = 0;
};

class ControlListener {
 public:
  // Binds the socket of image_path in the current user's directory (made 0700
  // if missing; refused if it is not ours or others may enter it). A socket
  // file already there that refuses connections is replaced; one with a live
  // daemon behind it is EADDRINUSE.
  static Result<ControlListener> open(const std::string& image_path);
  ControlListener() = default;
  ControlListener(ControlListener&& o) noexcept = default;
  ControlListener& operator=(ControlListener&& o) noexcept;
  ~ControlListener();  // removes the socket file (if it is still ours)

  int fd() const { return fd_.get(); }
  const std::string& path() const { return path_; }
  // The next waiting connection (non-blocking; EAGAIN when there is none),
  // with its peer's credentials.
  Result<ControlPeer> accept() const;

 private:
  void remove_file();
  UniqueFd fd_;
  std::string path_;
  ino_t ino_ = 0;  // the socket file we bound
};

// Reads one '\n'-terminated line (without the newline) from a non-blocking
// fd, at most max_bytes, by deadline: ETIMEDOUT after it, EPROTO on EOF first.
Result<std::string> read_control_line(int fd, ControlClock::time_point deadline, size_t max_bytes);
// Writes all of text to a non-blocking fd by deadline (ETIMEDOUT after it).
Status write_control_text(int fd, const std::string& text, ControlClock::time_point deadline);

// Connects to the socket at path (non-blocking afterwards). ECONNREFUSED or
// ENOENT: no daemon there; EACCES: not ours to use.
Result<UniqueFd> connect_control(const std::string& path);

}  // namespace qcowfs::io
