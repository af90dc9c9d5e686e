// libFuzzer target: L1/L2 entry classification and decoding (standard, extended, compressed) and
// cluster decompression (zlib and zstd) over arbitrary bytes, checking that
// every decoded run stays inside its cluster and inside the image file.
// Input: 1 byte cluster_bits, 1 byte flags, 8 bytes file size, then records of
// (entry u64, bitmap u64, in_cluster u32, max_len u32); what is left over after
// 64 records is a compressed stream.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "image/qcow2/compress.h"
#include "image/qcow2/l2.h"

namespace q = qcowfs::image::qcow2;

namespace {

void check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz_l2 invariant broken: %s\n", what);
    std::abort();
  }
}

struct Reader {
  const uint8_t* p;
  size_t left;
  template <typename T>
  bool get(T* out) {
    if (left < sizeof(T)) return false;
    std::memcpy(out, p, sizeof(T));
    p += sizeof(T);
    left -= sizeof(T);
    return true;
  }
};

void check_run(const q::Geometry& g, const q::ClusterRun& r, uint64_t in_cluster, uint64_t max_len) {
  check(r.length > 0 && r.length <= max_len, "run length outside (0, max_len]");
  check(in_cluster + r.length <= g.cluster_size(), "run leaves its cluster");
  if (r.kind == qcowfs::image::ExtentKind::data && !g.external_data) {
    check(r.host_offset >= g.cluster_size(), "data run inside the header cluster");
    check(r.host_offset + r.length <= g.image_file_size + g.cluster_size(), "data run far past EOF");
  }
  if (r.kind == qcowfs::image::ExtentKind::compressed) {
    check(r.compressed.host_offset >= g.cluster_size(), "compressed stream in the header");
    check(r.compressed.host_offset < g.image_file_size, "compressed stream past EOF");
    check(r.compressed.size <= 2 * g.cluster_size() + 512, "compressed stream larger than possible");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Reader in{data, size};
  uint8_t bits = 0, flags = 0;
  uint64_t file_size = 0;
  if (!in.get(&bits) || !in.get(&flags) || !in.get(&file_size)) return 0;
  q::Geometry g;
  g.cluster_bits = q::kMinClusterBits + bits % (q::kMaxClusterBits - q::kMinClusterBits + 1);
  g.extended_l2 = (flags & 1) && g.cluster_bits >= 14;
  g.external_data = (flags & 2) != 0;
  g.image_file_size = file_size % (1ull << 50);
  const uint64_t cs = g.cluster_size();
  for (int i = 0; i < 64; ++i) {
    uint64_t entry = 0, bitmap = 0;
    uint32_t pos = 0, len = 0;
    if (!in.get(&entry) || !in.get(&bitmap) || !in.get(&pos) || !in.get(&len)) break;
    (void)q::decode_l1_entry(g, entry);
    uint64_t in_cluster = pos % cs;
    uint64_t max_len = 1 + len % (cs - in_cluster);
    auto r = q::decode_cluster_run(g, entry, bitmap, in_cluster, max_len);
    if (r) check_run(g, *r, in_cluster, max_len);
    auto c = q::classify_l2_entry(g, entry, bitmap);
    check(c.is_ok() == r.is_ok(), "classify_l2_entry and decode_cluster_run disagree");
    if (c) check(!c->owned() || c->allocated, "owned without a host cluster");
  }
  if (in.left > 0) {
    std::vector<std::byte> out(static_cast<size_t>(cs));
    std::span<const std::byte> stream(reinterpret_cast<const std::byte*>(in.p), in.left);
    (void)q::decompress_cluster(q::kCompressionZlib, stream, out);
    (void)q::decompress_cluster(q::kCompressionZstd, stream, out);
  }
  return 0;
}
