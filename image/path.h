// How an image names its other files: backing and external data file names
// stored in an image (or given to `qcowfs create -b`) are relative to the
// image's directory, spelled as QEMU's path_combine() spells them.
// Thread-safety: pure functions.
#pragma once

#include <string>

namespace qcowfs::image {

// `name` as seen from the image at `image_path`: an absolute name as is, a
// relative one after the image path up to its last slash (no normalisation,
// no realpath, as QEMU does). A URL ("https://...") is absolute; a relative
// name under a URL image is resolved the same way. An empty name names no file and stays empty
// (QEMU would give the image's directory; every caller checks first).
std::string resolve_relative(const std::string& image_path, const std::string& name);

}  // namespace qcowfs::image
