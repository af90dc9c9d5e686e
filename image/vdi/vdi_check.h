// `qcowfs check` for VDI images (image/check.h): QEMU 7.2's vdi_co_check().
// Thread-safety: as CheckFormatFn (the check owns the file meanwhile).
#pragma once

#include <string>

#include "image/check.h"

namespace qcowfs::image {

// Walks all blocks_in_image block map entries, as QEMU does (zeros past the
// end of the file, as QEMU reads them): an allocated entry not below
// blocks_in_image, a data block named by a second entry, and a header
// blocks_allocated that differs from the entries counted are corruptions,
// with QEMU's "ERROR: ..." lines. QEMU has no VDI repair: with a repair mode
// the check returns check_not_supported() (qemu-img's exit 63) once the header
// parses, and writes nothing.
Task<Result<CheckReport>> check_vdi(io::HostFile& file, std::string path, CheckOptions opts);

}  // namespace qcowfs::image
