// Describing an image: what `qcowfs info` (tools/info.cc) shows of one image,
// format-neutral, with qemu-img info's fields. A format whose description
// needs more than its driver's details() (qcow2's snapshot table and header
// fields read without a key, a LUKS header read without its passphrase)
// offers the registry (image/format.h) a DescribeFormatFn; every other format
// is described through its driver, opened alone (describe_image()).
// Thread-safety: free functions; the HostFile's own rules apply.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "image/block_driver.h"
#include "io/host_file.h"
#include "io/status.h"
#include "io/task.h"

namespace qcowfs::image {

struct FormatInfo;  // image/format.h

// One internal snapshot as qemu-img info lists it ("Snapshot list:", "snapshots").
struct SnapshotListing {
  std::string id;
  std::string name;
  uint64_t vm_state_size = 0;
  uint32_t date_sec = 0;
  uint32_t date_nsec = 0;
  uint64_t vm_clock_nsec = 0;
  std::optional<uint64_t> icount;  // nullopt: not recorded ("--")
};

// Everything info prints about one image besides its name and format.
struct ImageDescription {
  uint64_t virtual_size = 0;
  uint64_t actual_size = 0;  // host bytes of every file of the image
  // cluster size, backing file and format, dirty flag ("dirty-flag" is shown
  // when set), "encrypted", and the "format-specific" data.
  ImageDetails details;
  std::vector<SnapshotListing> snapshots;
};

// Describes an image of one format on its opened host file, without keys and
// without its backing file; path names it and resolves relative names; opts
// are as for opening it (format, file options, no_backing).
using DescribeFormatFn = Task<Result<ImageDescription>> (*)(std::unique_ptr<io::HostFile> file, std::string path,
                                                            ImageOptions opts);

// The description of an image of format `format`: its DescribeFormatFn, else
// its driver opened alone (opts.no_backing set here): the driver's size,
// allocated bytes (every file, as qemu-img adds them) and details().
Task<Result<ImageDescription>> describe_image(const FormatInfo& format, std::unique_ptr<io::HostFile> file,
                                              std::string path, ImageOptions opts);

}  // namespace qcowfs::image
