// Bitmap views: one persistent dirty bitmap of a disk (BlockDriver::
// dirty_bitmaps(), qcow2's) as a read-only disk of the same size whose data
// ranges (block_status, so SEEK_DATA/SEEK_HOLE through fuse/) are exactly the
// bitmap's dirty granules, which read the disk's current bytes; the clean
// ones are holes that read as zeros. A copy of the view's data ranges is an
// incremental backup since the bitmap was made or cleared (README
// "Incremental backups").
//
// Every read, block_status and allocated_bytes asks the disk for the bitmap
// as it is at that moment (a writable disk's bits grow with every write), so
// a read racing a write to the same range may see either, as a read of the
// disk itself would.
// Thread-safety: as BlockDriver; the disk is borrowed and must outlive the view.
#pragma once

#include <memory>
#include <string>

#include "image/block_driver.h"

namespace qcowfs::image {

// The view of bitmap `name` of disk (one that disk->dirty_bitmaps() lists
// consistent; should it disappear or turn inconsistent, requests fail with EIO).
std::unique_ptr<BlockDriver> make_bitmap_view(BlockDriver* disk, std::string name);

}  // namespace qcowfs::image
