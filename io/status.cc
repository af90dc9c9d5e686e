#include "io/status.h"

#include <cstring>
#include <cstdlib>

namespace qcowfs {

Status Status::from_errno(int err, std::string_view what) {
  if (err < 0) err = -err;
  if (err == 0) err = EIO;
  return Status(err, fmt::format("{}: {}", what, std::strerror(err)));
}

const std::string& Status::empty_message() {
  static const std::string empty;
  return empty;
}

std::string Status::to_string() const {
  if (is_ok()) return "ok";
  return message_ ? *message_ : std::string(std::strerror(code_));
}

Status Status::with_context(std::string_view context) const {
  if (is_ok()) return *this;
  return Status(code_, fmt::format("{}: {}", context, message()));
}

}  // namespace qcowfs
