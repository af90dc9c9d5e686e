// qcowfs create -f vpc: new VHD images as qemu-img 7.2 makes them
// (block/vpc.c vpc_co_create_opts, vpc_co_create): dynamic (default) or fixed
// disks, the size rounded up to a CHS geometry unless force_size=on.
// Thread-safety: prepare_vpc_create() is a pure function of its request; the
// Creator it returns is used once, by one thread (image/create.h).
#pragma once

#include <memory>

#include "image/create.h"

namespace qcowfs::image {

// The registry's PrepareCreateFn (image/format.h).
Result<std::unique_ptr<Creator>> prepare_vpc_create(const CreateRequest& request);

}  // namespace qcowfs::image
