// `qcowfs check` of a QED image: QEMU 7.2's qed_check() (block/qed-check.c)
// behind the registry's CheckFormatFn (image/check.h). Every L1 and L2 entry
// must be a valid table or cluster offset (invalid ones are corruptions, and
// with any -r they are cleared, as QEMU's fix does); every cluster may be
// named once (a second reference is a corruption no repair fixes); clusters
// after the header that nothing names are leaks (never repaired: QEMU frees
// nothing). With -r, a check that leaves no corruption clears the need-check
// bit (qed_check_mark_clean). total-clusters, allocated-clusters and
// fragmented-clusters as QEMU counts them; QED reports no image-end-offset.
// Thread-safety: as CheckFormatFn.
#pragma once

#include <string>

#include "image/check.h"

namespace qcowfs::image {

Task<Result<CheckReport>> check_qed(io::HostFile& file, std::string path, CheckOptions opts);

}  // namespace qcowfs::image
