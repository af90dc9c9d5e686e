// qcowfs create -f vmdk: new VMDK images as qemu-img 7.2 makes them
// (block/vmdk.c vmdk_co_create_opts, vmdk_co_do_create, vmdk_init_extent):
// the subformats monolithicSparse (default), monolithicFlat,
// twoGbMaxExtentSparse, twoGbMaxExtentFlat and streamOptimized, qemu-img's
// options and refusals, and delta disks over a VMDK parent.
// Thread-safety: prepare_vmdk_create() is a pure function of its request; the
// Creator it returns is used once, by one thread (image/create.h).
#pragma once

#include <memory>

#include "image/create.h"

namespace qcowfs::image {

// The registry's PrepareCreateFn (image/format.h).
Result<std::unique_ptr<Creator>> prepare_vmdk_create(const CreateRequest& request);

}  // namespace qcowfs::image
