// Qcow2Writer: truncate (grow or shrink the guest disk) and L1 table growth.
// Both hold the whole guest range locked exclusive.
#include <cstddef>

#include "image/endian.h"
#include "image/qcow2/writer_plan.h"
#include "io/align.h"

namespace qcowfs::image::qcow2 {
namespace {

// The header fields size, crypt_method, l1_size and l1_table_offset follow
// each other: an L1 switch writes them as one block starting at `size`.
constexpr size_t kL1SwitchStart = offsetof(HeaderLayout, size);
constexpr size_t kL1SwitchBytes = offsetof(HeaderLayout, l1_table_offset) + sizeof(uint64_t) - kL1SwitchStart;
static_assert(kL1SwitchBytes == 24);

constexpr size_t in_l1_switch(size_t header_offset) { return header_offset - kL1SwitchStart; }

}  // namespace

// Shrinking is refused while a cluster past the new end is allocated (its
// data would go silently); otherwise only the size field changes. The L1
// table keeps its size and place, as `qemu-img resize --shrink` leaves it
// (QEMU 7.2: qcow2_shrink_l1_table() zeroes the entries past the new end but
// never lowers l1_size); the L2 tables past the end map nothing and stay.
// Growing past the L1 table moves it (grow_l1).
Task<Status> Qcow2Writer::truncate(uint64_t new_size) {
  const uint64_t old_size = size();
  if (new_size == old_size) co_return Status::ok();
  QCOWFS_CO_TRY(img_.corruption.refuse_writes());
  // QEMU's qcow2_truncate_bitmaps_check: an inconsistent bitmap blocks a
  // resize; the loaded ones follow the new size (stored at close).
  QCOWFS_CO_TRY(bitmaps_->check_resize());
  QCOWFS_CO_TRY(co_await prepare());
  auto range = co_await reads_.ranges().lock(0, UINT64_MAX, io::RangeLock::Mode::exclusive);
  if (new_size < old_size) QCOWFS_CO_TRY(co_await check_tail_unallocated(new_size));
  // data_file_raw: the data file stays a raw image of the guest size, as QEMU keeps it.
  if (img_.header.data_file_raw()) QCOWFS_CO_TRY(co_await img_.data_file->truncate(new_size));
  const uint64_t entries = img_.header.l1_entries_for(new_size);
  if (entries > l1_.entries.size()) {
    QCOWFS_CO_TRY(co_await grow_l1(entries, new_size));
  } else {
    QCOWFS_CO_TRY(co_await write_size(new_size));
  }
  bitmaps_->resize(new_size);
  co_return Status::ok();
}

// EINVAL when a guest cluster between new_size and the current size is allocated.
Task<Status> Qcow2Writer::check_tail_unallocated(uint64_t new_size) {
  const Geometry& g = img_.geometry;
  const uint64_t cs = g.cluster_size();
  const size_t esz = g.l2_entry_size();
  auto m = co_await meta_.lock();
  for (GuestCluster gc = div_round_up(new_size, cs); gc < div_round_up(size(), cs); ++gc) {
    const uint64_t l1_index = gc / g.l2_entries();
    const HostOffset l2 = l1_.entries[l1_index] & kL1OffsetMask;
    if (l2 == 0) {
      gc = (l1_index + 1) * g.l2_entries() - 1;
      continue;
    }
    size_t index = 0;
    auto slice = co_await slice_for(l2, gc % g.l2_entries(), &index);
    if (!slice) co_return slice.status();
    const uint64_t entry = slice->be64(index * esz) & ~kOflagZero;
    const uint64_t bitmap = g.extended_l2 ? slice->be64(index * esz + kExtendedL2BitmapOffset) & kSubclusterAllocMask : 0;
    if (entry != 0 || bitmap != 0)
      co_return Status::errorf(EINVAL, "cannot shrink to {} bytes: guest offset {:#x} is allocated", new_size, gc * cs);
  }
  co_return Status::ok();
}

// A size-only change: one 8-byte header write + flush.
Task<Status> Qcow2Writer::write_size(uint64_t new_size) {
  auto m = co_await meta_.lock();
  QCOWFS_CO_TRY(co_await write_header_u64(offsetof(HeaderLayout, size), new_size));
  img_.header.size = new_size;
  size_.store(new_size, std::memory_order_release);
  co_return Status::ok();
}

// Moves the L1 table to a new place big enough for `entries`: everything
// written back, new clusters' refcounts durable, new table written and
// flushed, then one header write switches to it; the old table is released.
// Called with the whole guest range locked exclusively.
Task<Status> Qcow2Writer::grow_l1(uint64_t entries, uint64_t new_size) {
  const uint64_t cs = img_.geometry.cluster_size();
  if (entries * L1Table::kEntryBytes > kMaxL1Bytes)
    co_return Status::errorf(EFBIG, "a {} byte disk needs an L1 table larger than {} bytes", new_size, kMaxL1Bytes);
  auto wb = co_await writeback_lock_.lock();
  QCOWFS_CO_TRY(co_await writeback_locked());  // the old L1 on disk matches memory now
  const uint64_t clusters = div_round_up(entries * L1Table::kEntryBytes, cs);
  auto first_hc = co_await allocate_l1(clusters);
  if (!first_hc) co_return first_hc.status();
  // The new clusters' refcounts go to disk before anything points at them.
  Status st = co_await writeback_locked();
  auto m = co_await meta_.lock();
  if (st) st = co_await write_l1(*first_hc, clusters, entries, new_size);
  if (!st) {
    (void)co_await alloc_->release(*first_hc, clusters, nullptr);
    co_return st;
  }
  co_return co_await switch_l1(*first_hc, entries, new_size);
}

// `clusters` contiguous host clusters for the new L1 table (growing the
// refcount table as needed; the writeback lock is held).
Task<Result<HostCluster>> Qcow2Writer::allocate_l1(uint64_t clusters) {
  auto m = co_await meta_.lock();
  for (;;) {
    auto r = co_await alloc_->allocate(clusters);
    if (r) co_return *r;
    if (r.status().code() != EAGAIN) co_return r.status();
    QCOWFS_CO_TRY(co_await alloc_->grow_table());
  }
}

// Writes the new L1 table (the current entries, zeros after) and flushes,
// then size, crypt_method, l1_size and l1_table_offset in one header write.
Task<Status> Qcow2Writer::write_l1(HostCluster first_hc, uint64_t clusters, uint64_t entries, uint64_t new_size) {
  const uint64_t cs = img_.geometry.cluster_size();
  io::AlignedBuffer table(static_cast<size_t>(clusters * cs), img_.file->mem_align(), true);
  for (size_t i = 0; i < l1_.entries.size(); ++i) store_be64(table.data() + i * L1Table::kEntryBytes, l1_.entries[i]);
  QCOWFS_CO_TRY(co_await img_.file->write(first_hc * cs, table.span()));
  QCOWFS_CO_TRY(co_await img_.file->flush());
  std::byte hdr[kL1SwitchBytes];
  store_be64(hdr + in_l1_switch(offsetof(HeaderLayout, size)), new_size);
  store_be32(hdr + in_l1_switch(offsetof(HeaderLayout, crypt_method)), img_.header.crypt_method);
  store_be32(hdr + in_l1_switch(offsetof(HeaderLayout, l1_size)), static_cast<uint32_t>(entries));
  store_be64(hdr + in_l1_switch(offsetof(HeaderLayout, l1_table_offset)), first_hc * cs);
  co_return co_await write_header_bytes(kL1SwitchStart, hdr);
}

// The in-memory side of the switch; the old table's clusters are released.
Task<Status> Qcow2Writer::switch_l1(HostCluster first_hc, uint64_t entries, uint64_t new_size) {
  const uint64_t cs = img_.geometry.cluster_size();
  const HostOffset old_host = l1_.host_offset;
  const uint64_t old_clusters = div_round_up(l1_.bytes(), cs);
  l1_.entries.resize(entries, 0);
  l1_.host_offset = first_hc * cs;
  img_.header.l1_size = static_cast<uint32_t>(entries);
  img_.header.l1_table_offset = first_hc * cs;
  img_.header.size = new_size;
  size_.store(new_size, std::memory_order_release);
  if (old_clusters > 0 && old_host != 0) QCOWFS_CO_TRY(co_await alloc_->release(old_host / cs, old_clusters, nullptr));
  co_return Status::ok();
}

}  // namespace qcowfs::image::qcow2
