#include "image/qcow2/compress.h"

#include <zlib.h>
#include <zstd.h>
#include <zstd_errors.h>

#include <algorithm>
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
