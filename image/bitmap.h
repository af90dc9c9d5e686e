// Persistent dirty bitmaps: what `qcowfs bitmap` (tools/bitmap.cc) asks of a
// format, format-neutral, with the semantics and messages of qemu-img 7.2's
// `bitmap` command (QEMU's block-dirty-bitmap-add/remove/clear/enable/disable/
// merge). A format with persistent bitmaps (qcow2) offers the registry
// (image/format.h) a BitmapOps; for the others tools/ answers as qemu-img
// does for a driver without them.
//
// The operations run on an image file nobody else writes meanwhile (the
// caller holds QEMU's write lock); they follow the format's bitmap write
// ordering (image/qcow2/DESIGN.md, "Bitmap write ordering").
//
// Thread-safety: the functions own the HostFile they are given for their
// duration; all I/O goes through the calling thread's Engine.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "io/host_file.h"
#include "io/status.h"
#include "io/task.h"

namespace qcowfs::image {

namespace crypto {
class KeyProvider;  // image/crypto/secret.h
}

enum class BitmapActionKind : uint8_t { add, remove, clear, enable, disable, merge };

struct BitmapAction {
  BitmapActionKind kind = BitmapActionKind::add;
  std::string source;  // merge: the source bitmap's name
};

// A bitmap's dirty ranges, to merge from another image.
struct BitmapBits {
  uint64_t disk_size = 0;
  uint64_t granularity = 0;
  std::vector<std::pair<uint64_t, uint64_t>> dirty;  // (offset, length), ascending
};

struct BitmapRequest {
  std::string bitmap;                 // the bitmap every action works on
  std::vector<BitmapAction> actions;  // in command-line order
  uint64_t granularity = 0;           // --add's -g; 0: QEMU's default for the image
  // merge sources read from another image (-b), one per merge action in order;
  // empty: the sources are bitmaps of this image.
  std::vector<BitmapBits> merge_sources;
  // An encrypted image's passphrase (ImageOptions::keys); nullptr: the terminal's prompt.
  std::shared_ptr<crypto::KeyProvider> keys;
};

// The text of an operation for messages: "add", "remove", ...
constexpr std::string_view bitmap_action_name(BitmapActionKind kind) {
  switch (kind) {
    case BitmapActionKind::add: return "add";
    case BitmapActionKind::remove: return "remove";
    case BitmapActionKind::clear: return "clear";
    case BitmapActionKind::enable: return "enable";
    case BitmapActionKind::disable: return "disable";
    case BitmapActionKind::merge: return "merge";
  }
  return "?";
}

struct BitmapOps {
  // Runs req's actions in order on the image in file (opened read-write) and
  // stores the bitmaps. An action that fails stops the rest (what was done
  // before is kept, as qemu-img keeps it); the error reads "Operation OP on
  // bitmap NAME failed: ...".
  Task<Status> (*run)(std::unique_ptr<io::HostFile> file, std::string path, BitmapRequest req);
  // The dirty ranges of bitmap `name` of the image in file (opened read-only).
  Task<Result<BitmapBits>> (*read)(std::unique_ptr<io::HostFile> file, std::string path, std::string name);
};

}  // namespace qcowfs::image
