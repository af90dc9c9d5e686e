// Backing files: the one way a format opens the image its overlay names (qcow2's
// backing file, a VMDK delta's parent, a VHD differencing disk's parent), with
// the loop check that keeps a chain finite.
// Thread-safety: free functions; each call is independent.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "image/block_driver.h"

namespace qcowfs::image {

// The real path of path, refused with ELOOP when it is already part of the
// chain being opened (opts.backing_chain): the image is its own backing file.
Result<std::string> enter_backing_chain(const std::string& path, const ImageOptions& opts);

// How long a deferred backing file (below) waits after a failed open before
// the next read that needs it tries again.
inline constexpr std::chrono::seconds kDeferredRetry{5};

// Opens `name` as recorded by the overlay at overlay_path (a relative name is
// relative to the overlay's directory) read-only, with `format` if the overlay
// records one (else probed), the overlay's cache and locking options, and the
// chain extended by the overlay's real path. Errors name both files.
//
// With overlay_opts.defer_remote_backing and may_defer, a backing file named
// by URL (io::is_remote_location) that cannot be opened now (server down,
// unreachable, refusing) does not fail the overlay: a warning is logged and a
// stand-in driver is returned that opens it when a read or block status first
// needs it, again at most every kDeferredRetry after a failure. Until then
// those requests fail with EIO and a message naming the URL; ranges the
// overlay holds never ask. The stand-in's size is unknown (larger than any
// overlay) until it opens; past the real size it reads zeros. A format that
// must check its parent at open (VMDK's parentCID) passes may_defer = false.
Task<Result<std::unique_ptr<BlockDriver>>> open_backing_file(const std::string& overlay_path,
                                                            const std::string& name, const std::string& format,
                                                            const ImageOptions& overlay_opts, bool may_defer = true);

// Reads dst from the backing image at guest offset guest: the bytes past the
// backing image's end read as zeros (a backing file smaller than its overlay).
Task<Status> read_backing_range(BlockDriver& backing, uint64_t guest, std::span<std::byte> dst);

}  // namespace qcowfs::image
