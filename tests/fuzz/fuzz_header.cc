// libFuzzer target: qcow2 header and header-extension parsing, feature checks,
// serialisation round trip and snapshot table parsing over arbitrary bytes.
// Input: the first cluster of an image, optionally followed by a snapshot table.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "image/qcow2/header.h"
#include "image/qcow2/snapshot.h"

namespace q = qcowfs::image::qcow2;

namespace {

// Offsets in fuzzed headers are checked against a file this large.
constexpr uint64_t kFileSize = 1ull << 30;

void check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz_header invariant broken: %s\n", what);
    std::abort();
  }
}

// A header that parsed must serialise, and the result must parse back to the same geometry.
void round_trip(const q::Header& h) {
  auto bytes = q::serialize_header(h);
  if (!bytes) return;  // e.g. extensions too large for one cluster: refused, fine
  std::vector<std::byte> cluster(h.cluster_size(), std::byte{0});
  check(bytes->size() <= cluster.size(), "serialised header longer than a cluster");
  std::memcpy(cluster.data(), bytes->data(), bytes->size());
  auto again = q::parse_header(cluster, kFileSize);
  check(again.is_ok(), "serialised header does not parse");
  check(again->size == h.size && again->cluster_bits == h.cluster_bits && again->l1_size == h.l1_size &&
            again->l1_table_offset == h.l1_table_offset && again->backing_file == h.backing_file &&
            again->incompatible_features == h.incompatible_features && again->data_file == h.data_file,
        "round trip changed the header");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const std::byte> in(reinterpret_cast<const std::byte*>(data), size);
  auto cs = q::header_cluster_size(in.first(std::min(size, q::kHeaderProbeBytes)));
  if (!cs) return 0;
  check(*cs >= 512 && *cs <= (2u << 20), "cluster size out of range");
  std::vector<std::byte> cluster(static_cast<size_t>(*cs), std::byte{0});
  std::memcpy(cluster.data(), data, std::min<size_t>(size, cluster.size()));
  auto h = q::parse_header(cluster, kFileSize);
  if (!h) return 0;
  (void)q::check_features(*h, false);
  (void)q::check_features(*h, true);
  for (unsigned bit = 0; bit < 64; ++bit) (void)h->incompatible_feature_name(bit);
  round_trip(*h);
  if (size > cluster.size()) {
    auto t = q::parse_snapshot_table(in.subspan(cluster.size()), *h, kFileSize);
    if (t) check(t->needed_bytes > 0 || t->snapshots.size() == h->nb_snapshots, "snapshot count mismatch");
  }
  return 0;
}
