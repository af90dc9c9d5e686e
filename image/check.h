// Checking an image: what `qcowfs check` (tools/check.cc) asks of a format,
// format-neutral, with QEMU's BdrvCheckResult counters so the report and the
// exit code are qemu-img check's. A format that can be checked offers the
// registry (image/format.h) a CheckFormatFn.
//
// Thread-safety: a check owns the HostFile it is given for its duration; no
// other writer may use the image meanwhile (the caller holds QEMU's locks).
#pragma once

#include <cerrno>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "io/host_file.h"
#include "io/status.h"
#include "io/task.h"

namespace qcowfs::image {

// qemu-img check -r: nothing, leaks only, or everything it can.
enum class RepairMode { none, leaks, all };

// Counters as QEMU's BdrvCheckResult / `qemu-img check --output=json` name them.
struct CheckReport {
  uint64_t corruptions = 0;
  uint64_t leaks = 0;
  uint64_t check_errors = 0;
  uint64_t corruptions_fixed = 0;
  uint64_t leaks_fixed = 0;
  uint64_t image_end_offset = 0;
  uint64_t total_clusters = 0;      // clusters the guest size spans
  uint64_t allocated_clusters = 0;  // clusters with host space
  uint64_t fragmented_clusters = 0;
  uint64_t compressed_clusters = 0;
  // One line per problem found (and per repair made), in the order found.
  std::vector<std::string> messages;
  // Not 0: the check stopped with this errno after the findings in messages,
  // as a QEMU check that returns -errno (VMDK's): qemu-img then prints the
  // messages and "Check failed: <strerror>", no report, and exits 1.
  int failed_errno = 0;
};

struct CheckOptions {
  RepairMode repair = RepairMode::none;
  // Called now and then while walking, with the metadata bytes walked so far
  // and the bytes to walk in all (the last call has done == total).
  std::function<void(uint64_t done, uint64_t total)> progress;
};

// Checks (and with opts.repair, repairs) the image in `file` (opened writable
// when repairing); path names it in messages and resolves relative names. A
// Status error means the check could not be done at all (unreadable or
// unparseable header); problems found inside the image are counted in the
// report, and I/O failures half-way are check_errors. With a repair mode the
// report describes the image after the repair plus the *_fixed counters, as
// `qemu-img check -r` does after its "double checking" pass.
using CheckFormatFn = Task<Result<CheckReport>> (*)(io::HostFile& file, std::string path, CheckOptions opts);

// QEMU's "This image format does not support checks" (qemu-img check exit 63):
// what a CheckFormatFn returns where QEMU's check returns -ENOTSUP, e.g. for a
// repair mode the format does not offer (VDI with -r). Kept apart from the
// ENOTSUP of an unsupported header, which qemu-img reports as a failed open.
inline constexpr std::string_view kNoChecksMessage = "This image format does not support checks";
inline Status check_not_supported() { return Status::error(ENOTSUP, std::string(kNoChecksMessage)); }
inline bool is_check_not_supported(const Status& s) { return s.code() == ENOTSUP && s.message() == kNoChecksMessage; }

}  // namespace qcowfs::image
