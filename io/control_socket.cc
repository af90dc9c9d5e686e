#include "io/control_socket.h"

#include <fcntl.h>
#include <glob.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <nettle/sha2.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "io/remote/canonical_url.h"
#include "io/remote/remote_options.h"

namespace qcowfs::io {
namespace {

constexpr const char* kRootControlDir = "/run/qcowfs";

Result<sockaddr_un> control_address(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof addr.sun_path)
    return Status::errorf(ENAMETOOLONG, "control socket path {} is too long for a unix socket", path);
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  return addr;
}

// The milliseconds left until deadline, for poll (0 once it passed).
int control_ms_left(ControlClock::time_point deadline) {
  auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - ControlClock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, 3'600'000));
}

Status control_wait(int fd, short events, ControlClock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    int n = ::poll(&p, 1, control_ms_left(deadline));
    if (n > 0) return Status::ok();
    if (n == 0) return Status::error(ETIMEDOUT, "the other end of the control socket did not answer in time");
    if (errno != EINTR) return Status::from_errno(errno, "poll on the control socket");
  }
}

// The directory is made if missing; it must be ours and closed to others.
Status make_control_directory(const std::string& dir) {
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) return Status::from_errno(errno, dir);
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) return Status::from_errno(errno, dir);
  if (!S_ISDIR(st.st_mode) || st.st_uid != ::geteuid())
    return Status::errorf(EPERM, "{} is not a directory of this user: no control socket", dir);
  if ((st.st_mode & 077) != 0 && ::chmod(dir.c_str(), 0700) != 0) return Status::from_errno(errno, dir);
  return Status::ok();
}

}  // namespace

std::string control_directory(uid_t uid) {
  if (uid == 0) return kRootControlDir;
  const char* xdg = std::getenv("XDG_RUNTIME_DIR");
  if (xdg && *xdg == '/') return std::string(xdg) + "/qcowfs";
  std::string run_user = fmt::format("/run/user/{}", uid);
  struct stat st {};
  if (::stat(run_user.c_str(), &st) == 0 && S_ISDIR(st.st_mode) && st.st_uid == uid) return run_user + "/qcowfs";
  return "";
}

namespace {
// A URL's socket: SHA-256 of the URL's canonical form (128 bits of it, hex).
// The canonical form may hold the URL's user name: it is hashed, never logged.
std::string url_socket_name(const std::string& url) {
  const std::string canonical = canonical_remote_location(url);
  sha256_ctx ctx;
  sha256_init(&ctx);
  sha256_update(&ctx, canonical.size(), reinterpret_cast<const uint8_t*>(canonical.data()));
  uint8_t digest[SHA256_DIGEST_SIZE];
  sha256_digest(&ctx, sizeof digest, digest);
  std::string name = "url-";
  for (size_t i = 0; i < 16; ++i) name += fmt::format("{:02x}", digest[i]);
  return name + ".sock";
}
}  // namespace

Result<std::string> control_socket_name(const std::string& image_path) {
  if (is_remote_location(image_path)) return url_socket_name(image_path);
  struct stat st {};
  if (::stat(image_path.c_str(), &st) != 0) return Status::from_errno(errno, image_path);
  return fmt::format("{:x}-{:x}.sock", static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino));
}

Result<std::vector<std::string>> control_socket_candidates(const std::string& image_path) {
  auto name = control_socket_name(image_path);
  if (!name) return name.status();
  std::vector<std::string> out;
  const uid_t uid = ::geteuid();
  if (std::string own = control_directory(uid); !own.empty()) out.push_back(own + "/" + *name);
  if (uid != 0) {
    out.push_back(std::string(kRootControlDir) + "/" + *name);
    return out;
  }
  glob_t g{};
  std::string pattern = "/run/user/*/qcowfs/" + *name;
  if (::glob(pattern.c_str(), GLOB_NOSORT, nullptr, &g) == 0)
    for (size_t i = 0; i < g.gl_pathc; ++i) out.emplace_back(g.gl_pathv[i]);
  ::globfree(&g);
  return out;
}

Result<ControlListener> ControlListener::open(const std::string& image_path) {
  const std::string dir = control_directory(::geteuid());
  if (dir.empty()) return Status::error(ENOENT, "no runtime directory (XDG_RUNTIME_DIR) for a control socket");
  QCOWFS_TRY(make_control_directory(dir));
  auto name = control_socket_name(image_path);
  if (!name) return name.status();
  const std::string path = dir + "/" + *name;
  auto addr = control_address(path);
  if (!addr) return addr.status();
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) return Status::from_errno(errno, "control socket");
  const auto* sa = reinterpret_cast<const sockaddr*>(&*addr);
  if (::bind(fd.get(), sa, sizeof *addr) != 0) {
    if (errno != EADDRINUSE) return Status::from_errno(errno, path);
    auto live = connect_control(path);
    if (live) return Status::errorf(EADDRINUSE, "{}: another qcowfs daemon serves this image's control socket", path);
    ::unlink(path.c_str());  // a daemon that is gone left it behind
    if (::bind(fd.get(), sa, sizeof *addr) != 0) return Status::from_errno(errno, path);
  }
  if (::chmod(path.c_str(), 0600) != 0 || ::listen(fd.get(), 8) != 0) {
    Status st = Status::from_errno(errno, path);
    ::unlink(path.c_str());
    return st;
  }
  struct stat st {};
  ControlListener l;
  l.ino_ = ::stat(path.c_str(), &st) == 0 ? st.st_ino : 0;
  l.fd_ = std::move(fd);
  l.path_ = path;
  return l;
}

ControlListener& ControlListener::operator=(ControlListener&& o) noexcept {
  if (this != &o) {
    remove_file();
    fd_ = std::move(o.fd_);
    path_ = std::move(o.path_);
    ino_ = o.ino_;
  }
  return *this;
}

ControlListener::~ControlListener() { remove_file(); }

void ControlListener::remove_file() {
  if (!fd_.valid() || path_.empty()) return;
  struct stat st {};
  if (::stat(path_.c_str(), &st) == 0 && st.st_ino == ino_) ::unlink(path_.c_str());  // not a successor's
  fd_.reset();
}

Result<ControlPeer> ControlListener::accept() const {
  UniqueFd conn(::accept4(fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
  if (!conn.valid()) return Status::from_errno(errno, "accepting on the control socket");
  ucred cred{};
  socklen_t len = sizeof cred;
  if (::getsockopt(conn.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0)
    return Status::from_errno(errno, "SO_PEERCRED on the control socket");
  return ControlPeer{std::move(conn), cred.uid, cred.pid};
}

Result<std::string> read_control_line(int fd, ControlClock::time_point deadline, size_t max_bytes) {
  std::string line;
  char buf[4096];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n > 0) {
      line.append(buf, static_cast<size_t>(n));
      if (auto nl = line.find('\n'); nl != std::string::npos) return line.substr(0, nl);
      if (line.size() > max_bytes) return Status::errorf(EMSGSIZE, "control message longer than {} bytes", max_bytes);
      continue;
    }
    if (n == 0) return Status::error(EPROTO, "the control connection closed before a whole line");
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return Status::from_errno(errno, "reading the control socket");
    QCOWFS_TRY(control_wait(fd, POLLIN, deadline));
  }
}

Status write_control_text(int fd, const std::string& text, ControlClock::time_point deadline) {
  size_t done = 0;
  while (done < text.size()) {
    ssize_t n = ::send(fd, text.data() + done, text.size() - done, MSG_NOSIGNAL);
    if (n > 0) {
      done += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return Status::from_errno(errno, "writing the control socket");
    QCOWFS_TRY(control_wait(fd, POLLOUT, deadline));
  }
  return Status::ok();
}

Result<UniqueFd> connect_control(const std::string& path) {
  auto addr = control_address(path);
  if (!addr) return addr.status();
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return Status::from_errno(errno, "control socket");
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&*addr), sizeof *addr) != 0)
    return Status::from_errno(errno, path);
  int flags = ::fcntl(fd.get(), F_GETFL);
  if (flags < 0 || ::fcntl(fd.get(), F_SETFL, flags | O_NONBLOCK) != 0) return Status::from_errno(errno, path);
  return fd;
}

}  // namespace qcowfs::io
