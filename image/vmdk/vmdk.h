// VMDK images, as QEMU 7.2's block/vmdk.c reads them:
// monolithicSparse and streamOptimized files ("KDMV" sparse extents, also the
// VMFS "COWD" kind) and text descriptors listing FLAT, VMFS, SPARSE and
// VMFSSPARSE extent files (monolithicFlat, twoGbMaxExtentSparse/Flat, ...),
// with a delta disk's parent opened as its backing image (refused when the
// parent was written since the delta was made: its CID is not the delta's
// parentCID). DESIGN.md has the details; writer.h the read-write opens.
// Thread-safety: open_vmdk() is a free function; the driver is an ExtentDriver.
#pragma once

#include <memory>
#include <string>

#include "image/block_driver.h"

namespace qcowfs::image {

// The registry's entry point (image/format.h).
Task<Result<std::unique_ptr<BlockDriver>>> open_vmdk(std::unique_ptr<io::HostFile> file, std::string path,
                                                     ImageOptions opts);

}  // namespace qcowfs::image
