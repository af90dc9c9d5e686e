// The registry of image formats: the one list of every format qcowfs knows by
// name, and for each the function that opens it (nullptr for a format qcowfs
// only recognises, so that it is refused with a message naming it instead of
// being served, and written, as if it were a raw disk), and where the format
// has them, the functions behind `qcowfs create`, `check` and `info`: tools/
// reaches a format only through this table.
//
// A format lives in its own folder (image/raw/, image/qcow2/, ...) and offers
// the registry one OpenFormatFn through its public header; image/formats.cc
// holds the table, image/probe.h tells the formats apart by their bytes and
// image/open.cc turns a probed or named format into a driver or a refusal.
// Thread-safety: the table is immutable.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "image/bitmap.h"
#include "image/block_driver.h"
#include "image/check.h"
#include "image/create.h"
#include "image/describe.h"
#include "image/snapshot.h"

namespace qcowfs::image {

// Opens an image of one format on an already opened host file. path resolves
// relative backing and data file names and names the image in messages.
using OpenFormatFn = Task<Result<std::unique_ptr<BlockDriver>>> (*)(std::unique_ptr<io::HostFile> file,
                                                                    std::string path, ImageOptions opts);

struct FormatInfo {
  std::string_view name;     // QEMU's driver name: "qcow2", "raw", "vmdk", "vpc", ...
  std::string_view display;  // for messages: "VMDK", "VHD (vpc)", ...
  OpenFormatFn open;         // nullptr: recognised only, refused when opened
  // `qcowfs create -f NAME` (image/create.h); nullptr: the format makes no new images.
  PrepareCreateFn prepare_create = nullptr;
  // `qcowfs check` (image/check.h); nullptr: "This image format does not support checks".
  CheckFormatFn check = nullptr;
  // `qcowfs info` (image/describe.h); nullptr: described through its driver's details().
  DescribeFormatFn describe = nullptr;
  // `qcowfs snapshot` (image/snapshot.h); nullptr: no internal snapshots.
  const SnapshotOps* snapshot = nullptr;
  // `qcowfs bitmap` (image/bitmap.h); nullptr: no persistent dirty bitmaps.
  const BitmapOps* bitmap = nullptr;
  bool supported() const { return open != nullptr; }
};

// Every format, raw first.
std::span<const FormatInfo> all_formats();

// The entry for a format name as given with format= or backing_fmt= (QEMU's
// driver names, plus "vhd" for "vpc"); nullptr for a name qcowfs does not know.
const FormatInfo* find_format(std::string_view name);

// The names of the formats qcowfs opens, for messages: "raw, qcow2".
std::string supported_format_names();

// The format `qcowfs create` makes without -f (qemu-img's default, qcow2), and
// the names of the formats it makes, for messages: "raw, qcow2, vmdk, ...".
std::string_view default_create_format();
std::string creatable_format_names();

}  // namespace qcowfs::image
