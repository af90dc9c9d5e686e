#include "image/qcow2/compress.h"

#include <zlib.h>
#include <zstd.h>
#include <zstd_errors.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <memory>

#include "image/qcow2/format.h"

namespace qcowfs::image::qcow2 {
namespace {

Status inflate_cluster(std::span<const std::byte> in, std::span<std::byte> out) {
  z_stream s{};
  // Raw deflate (negative window bits: no zlib header), 4 KiB window as QEMU writes it.
  if (inflateInit2(&s, -kZlibWindowBits) != Z_OK) return Status::error(ENOMEM, "inflateInit2 failed");
  s.next_in = reinterpret_cast<Bytef*>(const_cast<std::byte*>(in.data()));
  s.avail_in = static_cast<uInt>(in.size());
  s.next_out = reinterpret_cast<Bytef*>(out.data());
  s.avail_out = static_cast<uInt>(out.size());
  int ret = inflate(&s, Z_FINISH);
  bool full = s.avail_out == 0;
  inflateEnd(&s);
  // Z_BUF_ERROR with a full output: the input carries bytes past this stream.
  if ((ret == Z_STREAM_END || ret == Z_BUF_ERROR) && full) return Status::ok();
  return Status::errorf(EIO, "corrupt deflate stream (zlib result {}, {} of {} bytes produced)", ret,
                        out.size() - s.avail_out, out.size());
}

struct DctxFree {
  void operator()(ZSTD_DCtx* d) const { ZSTD_freeDCtx(d); }
};

Status zstd_cluster(std::span<const std::byte> in, std::span<std::byte> out) {
  std::unique_ptr<ZSTD_DCtx, DctxFree> dctx(ZSTD_createDCtx());
  if (!dctx) return Status::error(ENOMEM, "ZSTD_createDCtx failed");
  ZSTD_inBuffer input{in.data(), in.size(), 0};
  ZSTD_outBuffer output{out.data(), out.size(), 0};
  size_t ret = 0;
  while (output.pos < output.size) {
    size_t in_before = input.pos, out_before = output.pos;
    ret = ZSTD_decompressStream(dctx.get(), &output, &input);
    if (ZSTD_isError(ret)) return Status::errorf(EIO, "corrupt zstd stream: {}", ZSTD_getErrorName(ret));
    if (input.pos == in_before && output.pos == out_before)
      return Status::errorf(EIO, "zstd stream ends after {} of {} bytes", output.pos, output.size);
  }
  // A frame still unfinished with the cluster full would produce more than a cluster.
  if (ret != 0) return Status::error(EIO, "zstd stream decompresses to more than one cluster");
  return Status::ok();
}

// One deflate context per thread, reset for each cluster (the output is the
// same as from a fresh context, as QEMU makes for each cluster).
class ThreadDeflater {
 public:
  ThreadDeflater() {
    ok_ = deflateInit2(&s_, Z_DEFAULT_COMPRESSION, Z_DEFLATED, -kZlibWindowBits, kZlibMemLevel, Z_DEFAULT_STRATEGY) ==
          Z_OK;
  }
  ~ThreadDeflater() {
    if (ok_) deflateEnd(&s_);
  }
  ThreadDeflater(const ThreadDeflater&) = delete;
  ThreadDeflater& operator=(const ThreadDeflater&) = delete;

  Result<size_t> deflate_cluster(std::span<const std::byte> in, std::span<std::byte> out) {
    if (!ok_) return Status::error(ENOMEM, "deflateInit2 failed");
    if (deflateReset(&s_) != Z_OK) return Status::error(EIO, "deflateReset failed");
    s_.next_in = reinterpret_cast<Bytef*>(const_cast<std::byte*>(in.data()));
    s_.avail_in = static_cast<uInt>(in.size());
    s_.next_out = reinterpret_cast<Bytef*>(out.data());
    s_.avail_out = static_cast<uInt>(out.size());
    const int ret = deflate(&s_, Z_FINISH);
    if (ret == Z_STREAM_END) return out.size() - s_.avail_out;
    if (ret == Z_OK || ret == Z_BUF_ERROR) return size_t{0};  // out is full: does not shrink enough
    return Status::errorf(EIO, "deflate failed (zlib result {})", ret);
  }

 private:
  // zlib's default memLevel, as QEMU passes it.
  static constexpr int kZlibMemLevel = 9;
  z_stream s_{};
  bool ok_ = false;
};

// Order-0 entropy, in bits per byte, of n samples counted in `counts`.
double entropy_bits(const std::array<uint32_t, 256>& counts, size_t n) {
  double sum = 0;
  for (uint32_t c : counts)
    if (c != 0) sum += c * std::log2(static_cast<double>(c));
  return std::log2(static_cast<double>(n)) - sum / static_cast<double>(n);
}

// Byte values of `in`, and (deltas) the differences of neighbouring bytes.
void count_bytes(std::span<const std::byte> in, bool deltas, std::array<uint32_t, 256>& out) {
  std::array<std::array<uint32_t, 256>, 4> part{};  // four tables: no stall on repeated bytes
  const auto* p = reinterpret_cast<const uint8_t*>(in.data());
  size_t i = 0;
  uint8_t prev = 0;
  for (; i + 4 <= in.size(); i += 4) {
    if (deltas) {
      ++part[0][static_cast<uint8_t>(p[i] - prev)];
      ++part[1][static_cast<uint8_t>(p[i + 1] - p[i])];
      ++part[2][static_cast<uint8_t>(p[i + 2] - p[i + 1])];
      ++part[3][static_cast<uint8_t>(p[i + 3] - p[i + 2])];
    } else {
      ++part[0][p[i]];
      ++part[1][p[i + 1]];
      ++part[2][p[i + 2]];
      ++part[3][p[i + 3]];
    }
    prev = p[i + 3];
  }
  for (; i < in.size(); prev = p[i], ++i) ++part[0][deltas ? static_cast<uint8_t>(p[i] - prev) : p[i]];
  for (size_t v = 0; v < 256; ++v) out[v] = part[0][v] + part[1][v] + part[2][v] + part[3][v];
}

}  // namespace

bool looks_incompressible(std::span<const std::byte> in) {
  // Thresholds: n uniformly random bytes measure about 8 - 184/n bits per
  // byte (the plug-in estimate's bias), so 7.977 for 8 KiB and 7.997 for a
  // 64 KiB cluster; English text measures about 4.5-5, x86 code about 6,
  // gzip and JPEG data 7.99+.
  constexpr size_t kProbe = 8192;
  constexpr double kProbeBits = 7.9, kClusterBits = 7.99;
  if (in.size() < kProbe) return false;
  std::array<uint32_t, 256> counts{};
  count_bytes(in.first(kProbe), false, counts);  // most clusters stop here
  if (entropy_bits(counts, kProbe) < kProbeBits) return false;
  count_bytes(in, false, counts);
  if (entropy_bits(counts, in.size()) < kClusterBits) return false;
  // Evenly spread bytes in a regular order (0, 1, 2, ..., 255, 0, 1, ...)
  // compress well: their differences do not spread.
  count_bytes(in, true, counts);
  return entropy_bits(counts, in.size()) >= kClusterBits;
}

namespace {

struct CctxFree {
  void operator()(ZSTD_CCtx* c) const { ZSTD_freeCCtx(c); }
};

// One zstd frame in as many calls as it takes to flush it (QEMU uses the
// streaming interface too); 0 when it does not fit in out.
Result<size_t> zstd_compress_cluster(std::span<const std::byte> in, std::span<std::byte> out) {
  thread_local std::unique_ptr<ZSTD_CCtx, CctxFree> cctx(ZSTD_createCCtx());
  if (!cctx) return Status::error(ENOMEM, "ZSTD_createCCtx failed");
  ZSTD_CCtx_reset(cctx.get(), ZSTD_reset_session_only);  // drops a frame a previous call left unfinished
  ZSTD_inBuffer input{in.data(), in.size(), 0};
  ZSTD_outBuffer output{out.data(), out.size(), 0};
  for (;;) {
    const size_t before = output.pos;
    const size_t ret = ZSTD_compressStream2(cctx.get(), &output, &input, ZSTD_e_end);
    if (ZSTD_isError(ret)) {
      if (ZSTD_getErrorCode(ret) == ZSTD_error_dstSize_tooSmall) return size_t{0};
      return Status::errorf(EIO, "zstd compression failed: {}", ZSTD_getErrorName(ret));
    }
    if (ret == 0) return output.pos;
    if (output.pos == output.size || output.pos == before) return size_t{0};
  }
}

}  // namespace

Result<size_t> compress_cluster(uint8_t compression_type, std::span<const std::byte> in, std::span<std::byte> out) {
  switch (compression_type) {
    case kCompressionZlib: {
      if (looks_incompressible(in)) return size_t{0};
      thread_local ThreadDeflater deflater;
      return deflater.deflate_cluster(in, out);
    }
    case kCompressionZstd: return zstd_compress_cluster(in, out);
    default: return Status::errorf(EINVAL, "unknown compression type {}", compression_type);
  }
}

Status decompress_cluster(uint8_t compression_type, std::span<const std::byte> in, std::span<std::byte> out) {
  switch (compression_type) {
    case kCompressionZlib: return inflate_cluster(in, out);
    case kCompressionZstd: return zstd_cluster(in, out);
    default: return Status::errorf(EIO, "unknown compression type {}", compression_type);
  }
}

}  // namespace qcowfs::image::qcow2
