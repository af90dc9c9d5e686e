// Throwaway writes (the mount option throwaway; QEMU's -snapshot): the image
// the user named, opened read-only, under a temporary qcow2 overlay that takes
// every write. The overlay is made by the qcow2 format's Creator through the
// registry (image/format.h) in a file without a name (io::create_unnamed_file:
// its space is freed when the overlay is closed, or the process killed) and
// opened with the image as its backing file: what was not written reads from
// the image; discarded and zeroed ranges become zero clusters, which hide the
// image's bytes. The overlay has the image's size; its flushes do nothing
// (cache=unsafe, as QEMU's temporary overlay: nothing in it outlives the mount).
// Thread-safety: one call per mount; the driver it returns is a BlockDriver.
#pragma once

#include <memory>
#include <string>

#include "image/block_driver.h"

namespace qcowfs::image {

// The overlay over `base` (which it owns from then on) in directory `dir`.
// opts: the mount's image options (table cache size and discard mode carry
// over). An image whose size is not a multiple of 512 bytes is refused (a
// qcow2 overlay could not have its size).
Task<Result<std::unique_ptr<BlockDriver>>> open_throwaway_overlay(std::unique_ptr<BlockDriver> base,
                                                                  const ImageOptions& opts, const std::string& dir);

}  // namespace qcowfs::image
