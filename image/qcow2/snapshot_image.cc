#include "image/qcow2/snapshot_image.h"

#include <algorithm>

#include "image/endian.h"
#include "image/extent/host_read.h"
#include "image/qcow2/metadata.h"
#include "image/qcow2/qcow2_check.h"
#include "image/qcow2/qcow2_inspect.h"
#include "io/align.h"
#include "io/buffer.h"

namespace qcowfs::image::qcow2 {
namespace {

// Refcount blocks kept in memory; dirty ones stay whatever the bound.
constexpr size_t kSnapshotRefcountCacheBlocks = 256;

Task<Status> write_header_field_bytes(io::HostFile& file, size_t offset, std::span<const std::byte> bytes) {
  QCOWFS_CO_TRY(co_await file.write(offset, bytes));
  co_return co_await file.flush();
}

// A dirty image's refcounts are recounted before anything trusts them, as
// QEMU's read-write open does (Qcow2Writer::repair_refcounts() does the same).
Task<Status> repair_dirty(io::HostFile& file, Header& h) {
  QCOWFS_CO_TRY(co_await rebuild_refcounts(file, h, OnCorruption::refuse));
  h.incompatible_features &= ~kIncompatDirty;
  std::byte b[sizeof(uint64_t)];
  store_be64(b, h.incompatible_features);
  co_return co_await write_header_field_bytes(file, offsetof(HeaderLayout, incompatible_features), b);
}

// Discards runs of freed clusters that are still free.
Task<Status> discard_freed(SnapshotImage& im) {
  std::vector<HostCluster> freed = std::move(im.freed);
  im.freed.clear();
  std::sort(freed.begin(), freed.end());
  freed.erase(std::unique(freed.begin(), freed.end()), freed.end());
  const uint32_t bits = im.header.cluster_bits;
  for (size_t i = 0; i < freed.size();) {
    size_t j = i + 1;
    while (j < freed.size() && freed[j] == freed[j - 1] + 1) ++j;
    // Best effort, as QEMU's discards: a host without hole punching keeps the bytes.
    (void)co_await im.file.discard(freed[i] << bits, (freed[j - 1] - freed[i] + 1) << bits);
    i = j;
  }
  co_return Status::ok();
}

}  // namespace

Task<Result<std::vector<uint64_t>>> read_l1_table(io::HostFile& file, const Header& h, HostOffset offset,
                                                  uint32_t entries) {
  const uint64_t bytes = uint64_t{entries} * kL1EntrySize;
  if (bytes > kMaxL1Bytes) co_return Status::errorf(EFBIG, "L1 table of {} entries is too large", entries);
  std::vector<uint64_t> l1(entries);
  if (entries == 0) co_return l1;
  if (!is_aligned(offset, h.cluster_size()) || !range_inside_file(offset, bytes, h.cluster_size(), file.size()))
    co_return Status::errorf(EIO, "L1 table at {:#x} ({} entries) is misaligned or outside the file", offset, entries);
  io::AlignedBuffer buf(static_cast<size_t>(bytes), file.mem_align());
  QCOWFS_CO_TRY(co_await read_padded(file, offset, buf.span(), "L1 table"));
  for (uint32_t i = 0; i < entries; ++i) l1[i] = load_be64(buf.data() + size_t{i} * kL1EntrySize);
  co_return l1;
}

Task<Status> write_l1_table(io::HostFile& file, HostOffset offset, std::span<const uint64_t> l1, uint64_t bytes) {
  if (bytes == 0) co_return Status::ok();
  io::AlignedBuffer buf(static_cast<size_t>(bytes), file.mem_align(), true);
  for (size_t i = 0; i < l1.size(); ++i) store_be64(buf.data() + i * kL1EntrySize, l1[i]);
  co_return co_await file.write(offset, buf.span());
}

Task<Result<std::unique_ptr<SnapshotImage>>> load_snapshot_image(io::HostFile& file) {
  auto im = std::make_unique<SnapshotImage>(file);
  auto h = co_await read_qcow2_header(file);
  if (!h) co_return h.status();
  im->header = std::move(*h);
  Header& hd = im->header;
  QCOWFS_CO_TRY(check_features(hd, true));
  if (hd.dirty()) QCOWFS_CO_TRY(co_await repair_dirty(file, hd));
  auto l1 = co_await read_l1_table(file, hd, hd.l1_table_offset, hd.l1_size);
  if (!l1) co_return l1.status().with_context("active L1 table");
  im->l1 = std::move(*l1);
  auto table = co_await read_qcow2_snapshots(file, hd);
  if (!table) co_return table.status();
  im->snapshots = std::move(table->snapshots);
  im->snapshots_bytes = table->table_bytes;
  auto rt = co_await RefcountTable::load(file, hd.cluster_bits, hd.refcount_order, hd.refcount_table_offset,
                                         hd.refcount_table_clusters, kSnapshotRefcountCacheBlocks);
  if (!rt) co_return rt.status();
  im->refcounts = std::move(*rt);
  auto used = co_await im->refcounts->end_of_used();
  if (!used) co_return used.status();
  im->alloc = std::make_unique<ClusterAllocator>(*im->refcounts, std::max(im->clusters_for(file.size()), *used));
  im->alloc->set_hint(0);  // reuse free clusters first, as QEMU's allocator does
  co_return im;
}

Task<Result<HostCluster>> allocate_clusters(SnapshotImage& im, uint64_t n) {
  for (;;) {
    auto hc = co_await im.alloc->allocate(n);
    if (hc || hc.status().code() != EAGAIN) co_return hc;
    QCOWFS_CO_TRY(co_await im.alloc->grow_table());
  }
}

Task<Status> release_range(SnapshotImage& im, HostOffset host, uint64_t bytes) {
  if (bytes == 0) co_return Status::ok();
  const uint32_t bits = im.header.cluster_bits;
  const HostCluster first = host >> bits, last = (host + bytes - 1) >> bits;
  co_return co_await im.alloc->release(first, last - first + 1, &im.freed);
}

Task<Status> write_refcounts(SnapshotImage& im) {
  RefcountTable& rt = *im.refcounts;
  WritebackBatch b;
  b.blocks = rt.dirty_blocks();
  b.reftable_entries = rt.dirty_table_entries();
  b.reftable_offset = rt.table_offset();
  QCOWFS_CO_TRY(co_await write_batch(im.file, im.file, b));
  for (const auto& blk : b.blocks) rt.mark_block_written(blk.index, blk.gen);
  for (const auto& [index, value] : b.reftable_entries) rt.mark_table_entry_written(index, value);
  co_return co_await discard_freed(im);
}

Task<Status> replace_snapshot_table(SnapshotImage& im, std::vector<Snapshot> next) {
  auto bytes = serialize_snapshot_table(next);
  if (!bytes) co_return bytes.status();
  HostOffset offset = 0;
  if (!bytes->empty()) {
    const uint64_t clusters = im.clusters_for(bytes->size());
    auto hc = co_await allocate_clusters(im, clusters);
    if (!hc) co_return hc.status();
    offset = *hc << im.header.cluster_bits;
    QCOWFS_CO_TRY(co_await write_refcounts(im));
    io::AlignedBuffer buf(static_cast<size_t>(clusters * im.cluster_size()), im.file.mem_align(), true);
    std::copy(bytes->begin(), bytes->end(), buf.data());
    QCOWFS_CO_TRY(co_await im.file.write(offset, buf.span()));
    QCOWFS_CO_TRY(co_await im.file.flush());
  }
  static_assert(offsetof(HeaderLayout, snapshots_offset) == offsetof(HeaderLayout, nb_snapshots) + sizeof(uint32_t));
  std::byte fields[sizeof(uint32_t) + sizeof(uint64_t)];
  store_be32(fields, static_cast<uint32_t>(next.size()));
  store_be64(fields + sizeof(uint32_t), offset);
  QCOWFS_CO_TRY(co_await write_header_field_bytes(im.file, offsetof(HeaderLayout, nb_snapshots), fields));
  const HostOffset old_offset = im.header.snapshots_offset;
  const uint64_t old_bytes = im.header.nb_snapshots ? im.snapshots_bytes : 0;
  im.header.nb_snapshots = static_cast<uint32_t>(next.size());
  im.header.snapshots_offset = offset;
  im.snapshots = std::move(next);
  im.snapshots_bytes = bytes->size();
  QCOWFS_CO_TRY(co_await release_range(im, old_offset, old_bytes));
  co_return co_await write_refcounts(im);
}

Task<Status> write_l1_location(SnapshotImage& im) {
  constexpr size_t kFirst = offsetof(HeaderLayout, size);
  constexpr size_t kEnd = offsetof(HeaderLayout, l1_table_offset) + sizeof(uint64_t);
  static_assert(kEnd - kFirst == 24, "size, crypt_method, l1_size and l1_table_offset are adjacent");
  std::byte fields[kEnd - kFirst];
  store_be64(fields + offsetof(HeaderLayout, size) - kFirst, im.header.size);
  store_be32(fields + offsetof(HeaderLayout, crypt_method) - kFirst, im.header.crypt_method);
  store_be32(fields + offsetof(HeaderLayout, l1_size) - kFirst, im.header.l1_size);
  store_be64(fields + offsetof(HeaderLayout, l1_table_offset) - kFirst, im.header.l1_table_offset);
  co_return co_await write_header_field_bytes(im.file, kFirst, fields);
}

}  // namespace qcowfs::image::qcow2
