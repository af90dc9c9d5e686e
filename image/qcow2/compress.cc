#include "image/qcow2/compress.h"

#include <zlib.h>
#include <zstd.h>

#include <algorithm>

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

}  // namespace

Status decompress_cluster(uint8_t compression_type, std::span<const std::byte> in, std::span<std::byte> out) {
  switch (compression_type) {
    case kCompressionZlib: return inflate_cluster(in, out);
    case kCompressionZstd: return zstd_cluster(in, out);
    default: return Status::errorf(EIO, "unknown compression type {}", compression_type);
  }
}

}  // namespace qcowfs::image::qcow2
