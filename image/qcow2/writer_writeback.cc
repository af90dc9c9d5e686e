// Qcow2Writer: write-back scheduling. Dirty metadata (MetadataTracker, the
// refcount table) goes to disk through write_batch (image/qcow2/metadata.h)
// on flush(), close(), idle_writeback() and when more than kMaxDirtySlices L2
// slices or kMaxDirtyBlocks refcount blocks are dirty (maybe_writeback after a
// request). The deferred reference drops of a batch are applied once it is
// durable. Also here: growing the refcount table when an allocation needs it.
#include <algorithm>

#include "image/qcow2/writer_plan.h"
#include "io/log.h"

namespace qcowfs::image::qcow2 {

Task<Status> Qcow2Writer::writeback() {
  auto wb = co_await writeback_lock_.lock();
  co_return co_await writeback_locked();
}

// Writeback lock held: takes a batch under the metadata lock, writes it
// without it, then records the result and applies the batch's releases.
Task<Status> Qcow2Writer::writeback_locked() {
  WritebackBatch batch;
  {
    auto m = co_await meta_.lock();
    batch = tracker_.take(*refcounts_, l1_.entries, l1_.host_offset);
  }
  Status st = co_await write_batch(*img_.file, *img_.data_file, batch);
  auto m = co_await meta_.lock();
  if (!st) {
    tracker_.failed(batch);
    co_return st;
  }
  tracker_.written(batch, *refcounts_, *img_.l2_cache);
  co_return co_await apply_releases(batch);
}

// Metadata lock held: the batch's refcount decreases; with discard=unmap the
// clusters that became free are punched at once.
Task<Status> Qcow2Writer::apply_releases(const WritebackBatch& batch) {
  std::vector<HostCluster> freed;
  for (const DeferredRelease& r : batch.releases) {
    Status rs = co_await alloc_->release(r.first_cluster, r.count, discard_unmap_ ? &freed : nullptr);
    if (!rs) {
      log::error("{}: dropping references to host clusters {:#x}+{}: {}", img_.path, r.first_cluster, r.count,
                 rs.message());
      co_return rs;
    }
  }
  co_return co_await discard_freed(std::move(freed));
}

// Freed clusters cannot be reused before the metadata lock is released: punch
// them now, one discard per run. Failures are logged, not returned.
Task<Status> Qcow2Writer::discard_freed(std::vector<HostCluster> freed) {
  std::sort(freed.begin(), freed.end());
  const uint32_t bits = img_.geometry.cluster_bits;
  for (size_t i = 0; i < freed.size();) {
    size_t j = i + 1;
    while (j < freed.size() && freed[j] == freed[j - 1] + 1) ++j;
    Status ds = co_await img_.file->discard(freed[i] << bits, (freed[j - 1] - freed[i] + 1) << bits);
    if (!ds) log::warn("{}: discarding freed host clusters at {:#x}: {}", img_.path, freed[i] << bits, ds.message());
    i = j;
  }
  co_return Status::ok();
}

void Qcow2Writer::note_dirty_amount() {
  if (tracker_.dirty_l2_slices() > kMaxDirtySlices || refcounts_->dirty_block_count() > kMaxDirtyBlocks)
    writeback_due_.store(true, std::memory_order_release);
}

Task<Status> Qcow2Writer::maybe_writeback() {
  if (!writeback_due_.load(std::memory_order_acquire)) co_return Status::ok();
  if (!writeback_lock_.try_lock()) co_return Status::ok();  // someone is writing back already
  io::AsyncMutex::Guard wb(&writeback_lock_);
  writeback_due_.store(false, std::memory_order_release);
  co_return co_await writeback_locked();
}

Task<Status> Qcow2Writer::flush() { co_return co_await check_corruption(co_await writeback()); }

Task<Status> Qcow2Writer::idle_writeback() {
  {
    auto m = co_await meta_.lock();
    if (!tracker_.has_dirty() && !refcounts_->has_dirty()) co_return Status::ok();
  }
  co_return co_await writeback();
}

Task<Status> Qcow2Writer::grow_refcount_table() {
  auto wb = co_await writeback_lock_.lock();
  auto m = co_await meta_.lock();
  co_return co_await alloc_->grow_table();
}

Task<Status> Qcow2Writer::with_refcount_room(io::AsyncMutex::Guard& m, const std::function<Task<Status>()>& step) {
  for (;;) {
    Status st = co_await step();
    if (st) co_return st;
    m.release();
    if (st.code() != EAGAIN) co_return co_await check_corruption(st);
    QCOWFS_CO_TRY(co_await grow_refcount_table());
    m = co_await meta_.lock();
  }
}

}  // namespace qcowfs::image::qcow2
