// Compressed qcow2 clusters: compression and decompression of one cluster
// (raw deflate with a 4 KiB window, or zstd); decompressed clusters are kept in
// image/extent/cluster_cache.h. Both are CPU work: the driver and the writer
// run them through io::offload.
// Thread-safety: both functions may run concurrently on any threads
// (compress_cluster() keeps one compression context per thread).
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

// Compresses the cluster `in` into `out` as QEMU writes compressed clusters:
// raw deflate with a 4 KiB window at zlib's default level, or one zstd frame
// at zstd's default level. Returns the stream's length, or 0 when it does not
// fit in `out` (QEMU offers one byte less than a cluster: a cluster that does
// not shrink is stored uncompressed). zlib: also 0, without running deflate,
// when looks_incompressible(in) (deflate is the fill's main cost, and
// already-compressed data is the usual cluster that does not shrink).
Result<size_t> compress_cluster(uint8_t compression_type, std::span<const std::byte> in, std::span<std::byte> out);

// Whether `in` (a cluster, 8 KiB or more) is data a raw deflate with a 4 KiB
// window cannot shrink worth a cluster's compression: its bytes and the
// differences of neighbouring bytes are both spread almost evenly over all
// 256 values (order-0 entropy of each at least 7.99 bits per byte), as in
// gzip, JPEG or encrypted data. Checks the first 8 KiB first, so it costs
// about a hundredth of a deflate on other data. Such a cluster could at best
// save a few bytes (on a disk of text and gzip files: 17 KB of 263 MiB).
bool looks_incompressible(std::span<const std::byte> in);

}  // namespace qcowfs::image::qcow2
