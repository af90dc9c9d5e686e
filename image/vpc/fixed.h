// The ExtentMap of a fixed VHD: the guest disk is the file's first bytes (the
// footer follows), one data extent at the same offset. QEMU 7.2's
// vpc_co_block_status() returns DATA | OFFSET_VALID | RECURSE for it, so the
// host file's holes (and bytes past its end) are "data": true, "zero": true:
// the extent is marked host_holes_are_zero and ExtentDriver asks the file.
// Thread-safety: immutable; try_map() is thread-safe.
#pragma once

#include "image/extent/driver.h"

namespace qcowfs::image::vpc {

class FixedMap final : public ExtentMap {
 public:
  explicit FixedMap(io::HostFile* file) : file_(file) {}
  Result<std::optional<Extent>> try_map(uint64_t guest, uint64_t len) override {
    Extent e;
    e.kind = ExtentKind::data;
    e.length = len;
    e.file = file_;
    e.host_offset = guest;
    e.host_holes_are_zero = true;
    return std::optional<Extent>(e);
  }

 private:
  io::HostFile* file_;
};

}  // namespace qcowfs::image::vpc
