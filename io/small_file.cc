#include "io/small_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace qcowfs::io {

std::string_view file_kind(unsigned st_mode) {
  switch (st_mode & S_IFMT) {
    case S_IFREG: return "a regular file";
    case S_IFDIR: return "a directory";
    case S_IFIFO: return "a FIFO";
    case S_IFSOCK: return "a socket";
    case S_IFCHR: return "a character device";
    case S_IFBLK: return "a block device";
    case S_IFLNK: return "a symbolic link";
    default: return "not a file";
  }
}

Result<SmallFile> SmallFile::open(const std::string& path, uint64_t limit, std::string_view what) {
  std::string name = fmt::format("{} {}", what, path);
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY));
  if (!fd.valid()) return Status::from_errno(errno, fmt::format("opening the {}", name));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return Status::from_errno(errno, fmt::format("examining the {}", name));
  if (!S_ISREG(st.st_mode))
    return Status::errorf(EINVAL, "{} is {}, not a regular file", name, file_kind(st.st_mode));
  const auto size = static_cast<uint64_t>(st.st_size);
  if (size > limit) return Status::errorf(EFBIG, "{} is {} bytes, more than the limit of {}", name, size, limit);
  return SmallFile(std::move(fd), static_cast<size_t>(size), std::move(name));
}

Status SmallFile::read(std::span<std::byte> out) const {
  size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::pread(fd_.get(), out.data() + done, out.size() - done, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Status::from_errno(errno, fmt::format("reading the {}", name_));
    if (n == 0) return Status::errorf(EIO, "reading the {}: it shrank to {} bytes while being read", name_, done);
    done += static_cast<size_t>(n);
  }
  return Status::ok();
}

}  // namespace qcowfs::io
