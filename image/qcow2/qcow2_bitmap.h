// qcow2's persistent dirty bitmaps for the format registry: the BitmapOps
// (image/bitmap.h) behind `qcowfs bitmap`, implemented in
// image/qcow2/bitmap_ops.cc on the writer (image/qcow2/bitmaps.h).
// Thread-safety: an immutable table of functions.
#pragma once

#include "image/bitmap.h"

namespace qcowfs::image {

extern const BitmapOps kQcow2BitmapOps;

}  // namespace qcowfs::image
