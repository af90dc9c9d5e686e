// libFuzzer target: the READ/WRITE/INTERRUPT decoding of
// Filesystem::serve_direct() (fuse/filesystem.cc) over arbitrary bytes.
// Input: one /dev/fuse-format message (fuse_in_header, arguments, payload).
// The filesystem has no image, so a served READ or WRITE ends in an error
// reply, which off an event-loop thread goes nowhere: what is fuzzed is the
// decoding (AddressSanitizer catches a read past the message). Invariant: a
// message shorter than its header, or whose length field is not its size, is
// never served.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <linux/fuse.h>

#include "fuse/filesystem.h"
#include "fuse/inode_table.h"

namespace f = qcowfs::fuse;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static f::Filesystem fs(f::InodeTable::directory_root(), f::AttrContext{}, f::Ino{0}, 0);
  std::vector<std::byte> message(size);  // exactly the input: reads past it are caught
  if (size) std::memcpy(message.data(), data, size);
  const bool served = fs.serve_direct(message);
  fuse_in_header in = {};
  if (size >= sizeof in) std::memcpy(&in, data, sizeof in);
  if (served && (size < sizeof in || in.len != size)) {
    std::fprintf(stderr, "fuzz_fuse_message invariant broken: served a message of %zu bytes, length %u\n", size,
                 in.len);
    std::abort();
  }
  return 0;
}
