#include "image/qcow2/metadata_prealloc.h"

#include <algorithm>

#include "image/qcow2/refcount.h"

namespace qcowfs::image::qcow2 {
namespace {

// Refcount blocks kept while counting: the scan is sequential.
constexpr size_t kScanCacheBlocks = 2;

}  // namespace

Task<Result<bool>> detect_metadata_preallocation(io::HostFile& image_file, const Header& h) {
  const uint64_t cs = h.cluster_size();
  const uint64_t real_clusters = image_file.allocated_bytes() / cs;
  const uint64_t threshold = std::max(real_clusters * 10 / 9, real_clusters + 2);
  const HostCluster end_hc = (image_file.size() + cs - 1) / cs;
  auto rt = co_await RefcountTable::load(image_file, h.cluster_bits, h.refcount_order, h.refcount_table_offset,
                                         h.refcount_table_clusters, kScanCacheBlocks);
  if (!rt) co_return rt.status();
  uint64_t used = 0;
  for (HostCluster hc = 0; hc < end_hc && used < threshold; ++hc) {
    std::optional<uint64_t> known = (*rt)->peek(hc);
    if (!known) {
      auto r = co_await (*rt)->get(hc);
      if (!r) co_return r.status();
      known = *r;
    }
    used += *known != 0;
  }
  co_return used >= threshold;
}

}  // namespace qcowfs::image::qcow2
