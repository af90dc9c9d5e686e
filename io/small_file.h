// SmallFile: a small regular file the user names on the command line (an
// encrypted image's key file), read whole into a buffer the caller provides
// (so a secret can go straight into locked memory). The open cannot block:
// O_NONBLOCK, so a FIFO or a device named by mistake is refused with a clear
// message instead of hanging; anything but a regular file is refused, and so
// is a file larger than the caller's limit.
//
// Thread-safety: a SmallFile is one caller's value.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "io/fd.h"
#include "io/status.h"

namespace qcowfs::io {

class SmallFile {
 public:
  // Opens path read-only (O_NONBLOCK | O_CLOEXEC | O_NOCTTY). what names the
  // file in messages ("key file"): "key file /tmp/k is a FIFO, not a regular
  // file" (EINVAL), "key file /tmp/k is 9000000 bytes, more than the limit of
  // 8388608" (EFBIG), or the open's errno.
  static Result<SmallFile> open(const std::string& path, uint64_t limit, std::string_view what);

  size_t size() const { return size_; }
  // Reads the whole file into out (out.size() == size()); EIO when the file
  // has shrunk since open.
  Status read(std::span<std::byte> out) const;

 private:
  SmallFile(UniqueFd fd, size_t size, std::string name) : fd_(std::move(fd)), size_(size), name_(std::move(name)) {}
  UniqueFd fd_;
  size_t size_ = 0;
  std::string name_;  // "key file PATH", for messages
};

// What a file of mode st_mode is, for messages: "a FIFO", "a directory", ...
std::string_view file_kind(unsigned st_mode);

}  // namespace qcowfs::io
