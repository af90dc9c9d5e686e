// What `qemu-img check` does before a format's check: open the image, so that
// an image the format refuses to open is refused by the check too ("Could not
// open ..."), with the format's own open-time checks and messages, and its
// backing chain opened as QEMU's check opens it.
// Thread-safety: a free function; the file is only read, by this call alone.
#pragma once

#include <string>

#include "image/format.h"

namespace qcowfs::image {

// Opens the image in `file` (borrowed: it stays the caller's) read-only with
// `open`, backing file included, and closes it again: the open's error if it
// fails, else ok.
Task<Status> open_for_check(io::HostFile& file, const std::string& path, OpenFormatFn open);

}  // namespace qcowfs::image
