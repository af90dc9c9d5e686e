#include "image/qed/writer.h"

#include <algorithm>
#include <cstddef>

#include "image/endian.h"
#include "image/qed/format.h"
#include "io/align.h"

namespace qcowfs::image::qed {

uint64_t QedWriter::l1_bytes_size(const QedMap& map) {
  return align_up(std::max<uint64_t>(map.l1_entries(), 1) * sizeof(uint64_t), kSectorSize);
}

QedWriter::QedWriter(io::HostFile& file, std::string path, const Header& h, QedMap& map,
                     io::AlignedBuffer header_sector, io::AlignedBuffer l1_bytes)
    : file_(file),
      path_(std::move(path)),
      h_(h),
      map_(map),
      header_(std::move(header_sector)),
      l1_bytes_(std::move(l1_bytes)),
      tail_{align_up(file.size(), h.cluster_size), file.size()} {}

// One 64-bit header field changed: QEMU writes the header's first sector
// (qed_write_header); we write it and flush.
Task<Status> QedWriter::write_header_field(size_t at, uint64_t value) {
  store_le64(header_.data() + at, value);
  QCOWFS_CO_TRY(co_await file_.write(0, header_.span().first(kSectorSize)));
  co_return co_await file_.flush();
}

Task<Status> QedWriter::write_features(uint64_t features) {
  QCOWFS_CO_TRY(co_await write_header_field(offsetof(HeaderLayout, features), features));
  h_.features = features;
  co_return Status::ok();
}

Task<Status> QedWriter::begin_change() {
  if (h_.need_check()) co_return Status::ok();
  QCOWFS_CO_TRY(co_await write_features(h_.features | kFeatureNeedCheck));
  need_check_set_ = true;
  co_return Status::ok();
}

// As bdrv_qed_co_truncate(): a size QED can have (whole sectors, at most
// qed_max_image_size), then the header's image_size in one sector write and a
// flush. The L1 entries the new size needs are in memory already (QedMap keeps
// the whole L1 table).
Task<Status> QedWriter::grow(uint64_t new_size) {
  const uint64_t max = max_image_size(h_.cluster_size, h_.table_size);
  if (new_size % kSectorSize != 0 || new_size > max)
    co_return Status::errorf(EINVAL, "Invalid image size specified: {} (QED takes whole sectors up to {} bytes)",
                             new_size, max);
  Header grown = h_;
  grown.image_size = new_size;
  if (grown.l1_entries() > map_.l1_entries())
    co_return Status::errorf(EFBIG, "{} bytes need {} QED L1 entries, more than qcowfs keeps ({})", new_size,
                             grown.l1_entries(), map_.l1_entries());
  QCOWFS_CO_TRY(co_await write_header_field(offsetof(HeaderLayout, image_size), new_size));
  h_.image_size = new_size;
  co_return Status::ok();
}

Task<Status> QedWriter::close_clean() {
  if (!need_check_set_) co_return Status::ok();
  QCOWFS_CO_TRY(co_await write_features(h_.features & ~kFeatureNeedCheck));
  need_check_set_ = false;
  co_return Status::ok();
}

// A zeroed table at the end of the file, then the L1 entry (in memory) names it.
Task<Status> QedWriter::new_l2_table(uint64_t l1_index) {
  const uint64_t at = tail_.next;
  if (file_.is_block_device() && at + h_.table_bytes() > file_.size())
    co_return Status::errorf(ENOSPC, "the QED image's block device is full ({} bytes)", file_.size());
  QCOWFS_CO_TRY(co_await file_.write_zeroes(at, h_.table_bytes()));
  tail_.next = at + h_.table_bytes();
  tail_.zero_from = std::max(tail_.zero_from, tail_.next);
  map_.grow_file(tail_.next);
  map_.set_l1_entry(l1_index, at);
  store_le64(l1_bytes_.data() + l1_index * sizeof(uint64_t), at);
  l1_dirty_.add(l1_index, 1);
  co_return Status::ok();
}

// Every L2 table the units need exists, and the slices holding their entries
// are loaded and pinned until publish() (one request may prepare several
// runs before it publishes them; pins left by a failed request go at the next
// write_metadata()).
Task<Status> QedWriter::prepare(uint64_t first, uint64_t n) {
  const uint64_t cs = h_.cluster_size;
  for (uint64_t u = first; u < first + n; ++u) {
    const uint64_t guest = u * cs;
    const uint64_t l1_index = guest >> h_.l1_shift;
    if (l1_index >= map_.l1_entries())
      co_return Status::errorf(EIO, "{}: guest offset {:#x} is past the QED L1 table", path_, guest);
    if (map_.l1_entry(l1_index) == kUnallocated) QCOWFS_CO_TRY(co_await new_l2_table(l1_index));
    const uint64_t slice = map_.entry_at(map_.l1_entry(l1_index), guest).slice;
    QCOWFS_CO_TRY(co_await slices_.pin(map_.cache(), slice, path_ + ": a QED L2 table"));
  }
  co_return Status::ok();
}

Task<Result<HostRun>> QedWriter::reserve(uint64_t /*first*/, uint64_t n) {
  if (file_.is_block_device() && tail_.next + n * h_.cluster_size > file_.size())
    co_return Status::errorf(ENOSPC, "the QED image's block device is full ({} bytes)", file_.size());
  co_return tail_.take(file_, n, h_.cluster_size);
}

void QedWriter::unreserve(const HostRun& run) { tail_.give_back(run, h_.cluster_size); }

void QedWriter::publish(uint64_t first, const HostRun& run) {
  const uint64_t cs = h_.cluster_size;
  map_.grow_file(run.host + run.units * cs);
  for (uint64_t i = 0; i < run.units; ++i) store(first + i, run.host + i * cs);
}

// QED's zero cluster (L2 entry 1), as QEMU's qed_co_pwrite_zeroes() writes
// whole unallocated clusters.
void QedWriter::mark_zero(uint64_t first, uint64_t n) {
  for (uint64_t u = first; u < first + n; ++u) store(u, kZeroCluster);
}

// The unit's L2 entry (its slice prepare()d) becomes entry.
void QedWriter::store(uint64_t unit, uint64_t entry) {
  const uint64_t guest = unit * h_.cluster_size;
  const QedMap::EntryAt where = map_.entry_at(map_.l1_entry(guest >> h_.l1_shift), guest);
  QedMap::store_entry(slices_.change(map_.cache(), where.slice), where.at, entry);
}

// Clusters written in part end the file early; QEMU takes the file's size
// rounded down to clusters as the end of valid offsets, so the file must
// cover every cluster before a table names it.
Task<Status> QedWriter::cover_allocated() {
  if (file_.is_block_device() || file_.size() >= tail_.next) co_return Status::ok();
  co_return co_await file_.truncate(tail_.next);
}

Task<Status> QedWriter::write_l1() {
  const auto [from, to] = l1_dirty_.sectors(0, sizeof(uint64_t), kSectorSize);
  auto bytes = l1_bytes_.span().subspan(static_cast<size_t>(from), static_cast<size_t>(to - from));
  QCOWFS_CO_TRY(co_await file_.write(h_.l1_table_offset + from, bytes));
  l1_dirty_.clear();
  co_return Status::ok();
}

Task<Status> QedWriter::write_metadata() {
  slices_.release_pins();  // no allocation is in flight (ExtentDriver::quiesce)
  if (!dirty()) co_return Status::ok();
  QCOWFS_CO_TRY(co_await cover_allocated());
  QCOWFS_CO_TRY(co_await slices_.write_dirty());
  if (l1_dirty_.empty()) co_return Status::ok();
  QCOWFS_CO_TRY(co_await file_.flush());
  co_return co_await write_l1();
}

}  // namespace qcowfs::image::qed
