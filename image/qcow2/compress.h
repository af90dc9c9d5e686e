// Compressed qcow2 clusters: decompression of one cluster (raw deflate with a
// 4 KiB window, or zstd); decompressed clusters are kept in image/extent/cluster_cache.h.
// decompress_cluster() is CPU work: the driver runs it through io::offload.
// Thread-safety: decompress_cluster() is a pure function.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "io/buffer.h"
#include "io/status.h"

namespace qcowfs::image::qcow2 {

// Fills all of `out` (one cluster) from the compressed stream `in`, stopping
// once the cluster is full. `in` may carry trailing bytes of the next stream.
// EIO when the stream is corrupt or ends before the cluster is full.
Status decompress_cluster(uint8_t compression_type, std::span<const std::byte> in, std::span<std::byte> out);

}  // namespace qcowfs::image::qcow2
