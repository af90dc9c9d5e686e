// Qcow2Writer: committing a written request to the metadata in memory (new L2
// entries, references to drop once those are on disk) or undoing its
// allocation when the data write failed. The metadata lock is held throughout;
// the changes reach the disk through MetadataTracker (writer_writeback.cc).
#include "image/endian.h"
#include "image/qcow2/writer_plan.h"
#include "io/align.h"

namespace qcowfs::image::qcow2 {

// Sets L2 entry `index` of `slice` and marks the slice dirty.
Task<Status> Qcow2Writer::set_l2(TableCache::Ref& slice, size_t index, uint64_t entry, uint64_t bitmap) {
  const size_t esz = img_.geometry.l2_entry_size();
  std::byte* p = slice.mutable_bytes().data() + index * esz;
  store_be64(p, entry);
  if (img_.geometry.extended_l2) store_be64(p + sizeof(uint64_t), bitmap);
  if (!tracker_.touch_l2(slice.host_offset())) {
    auto ref = co_await img_.l2_cache->get(slice.host_offset());
    if (!ref) co_return ref.status();
    tracker_.add_l2(std::move(*ref), *img_.l2_cache);
  }
  co_return Status::ok();
}

// Drops (once the new entry is on disk) the host clusters an old L2 entry held.
void Qcow2Writer::release_old(uint64_t entry) {
  const Geometry& g = img_.geometry;
  const L2EntryClass old = decode_l2_entry(g, entry, 0);  // the bitmap plays no part here
  if (old.kind == L2Kind::compressed) {
    const CompressedCluster& c = old.compressed;
    const HostOffset start = align_down(c.host_offset, kCompressedSectorSize);
    const HostOffset end = c.host_offset + c.size;  // sector aligned
    const HostCluster first_hc = start >> g.cluster_bits, last_hc = (end - 1) >> g.cluster_bits;
    tracker_.release_later(first_hc, last_hc - first_hc + 1);
    img_.cluster_cache->erase(c.host_offset);
    return;
  }
  if (old.host != 0 && !g.external_data) tracker_.release_later(old.host >> g.cluster_bits, 1);
}

Task<Status> Qcow2Writer::commit(Plan& plan) {
  const Geometry& g = img_.geometry;
  const uint64_t scs = g.subcluster_size();
  for (Slot& s : plan.slots) {
    if (s.kind == Kind::overwrite) continue;
    if (s.kind == Kind::compressed) {
      // No COPIED flag; with extended L2 an all-zero bitmap (QEMU's
      // qcow2_alloc_compressed_cluster_offset). A decompressed cluster cached
      // under this offset (a stream freed since) is stale.
      img_.cluster_cache->erase(s.host);
      QCOWFS_CO_TRY(co_await set_l2(plan.slices[s.slice], s.index, encode_compressed(g.cluster_bits, s.host, s.csize), 0));
      release_old(s.old_entry);
      continue;
    }
    uint64_t bitmap = 0;
    if (g.extended_l2) {
      // A whole-cluster write holds the complete contents (old ones copied in):
      // every subcluster is allocated. Otherwise the written subclusters become
      // allocated and the others keep their state.
      const uint64_t mask = subcluster_mask(s.map_start / scs, (s.map_end - 1) / scs);
      const bool whole = s.map_start == 0 && s.map_end == g.cluster_size();
      bitmap = whole ? kSubclusterAllocMask : (s.old_bitmap | mask) & ~(mask << kSubclusterZeroShift);
    }
    QCOWFS_CO_TRY(co_await set_l2(plan.slices[s.slice], s.index, s.host | kOflagCopied, bitmap));
    if (s.kind == Kind::allocate) release_old(s.old_entry);
  }
  note_dirty_amount();
  co_return Status::ok();
}

Task<Status> Qcow2Writer::undo(Plan& plan) {
  Status result;
  if (plan.run_clusters != 0) result = co_await alloc_->release(plan.first_hc, plan.run_clusters, nullptr);
  for (const Slot& s : plan.slots) {
    if (s.kind != Kind::compressed || !s.placed) continue;
    Status st = co_await release_stream(s);
    if (result && !st) result = st;
  }
  co_return result;
}

}  // namespace qcowfs::image::qcow2
