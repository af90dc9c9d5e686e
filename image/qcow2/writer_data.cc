// Qcow2Writer::write(): guest data and copy-on-write. A request is written in
// place when every cluster is a pure overwrite, otherwise mapped exclusively,
// allocated (with compress=on, its compressible clusters compressed first:
// writer_compress.cc), completed with its old contents (read through the
// ReadPath) and written as one writev per host-contiguous run, then committed
// (writer_commit.cc). QEMU's overlap check keeps guest data off metadata.
#include <algorithm>
#include <cstring>

#include "image/qcow2/writer_plan.h"
#include "io/align.h"
#include "io/log.h"
#include "io/when_all.h"

namespace qcowfs::image::qcow2 {

Task<Status> Qcow2Writer::write(GuestOffset guest, std::span<const std::byte> buf) {
  if (buf.empty()) co_return Status::ok();
  QCOWFS_CO_TRY(img_.corruption.refuse_writes());
  // The steps' own checks are made here first, so that the common overwrite
  // awaits no task it does not need (each is a coroutine frame and a handoff).
  if (state() == State::opened) QCOWFS_CO_TRY(co_await prepare());
  note_guest_change(guest, buf.size());
  auto in_place = co_await write_in_place(guest, buf);
  if (!in_place) co_return co_await check_corruption(in_place.status());
  if (!*in_place) {
    Status st = co_await write_allocating(guest, buf);
    if (!st) co_return co_await check_corruption(std::move(st));
  }
  if (!writeback_due_.load(std::memory_order_acquire)) co_return Status::ok();
  co_return co_await check_corruption(co_await maybe_writeback());
}

// The first pass: shared range lock, no metadata lock. It maps up to the first
// cluster that needs a mapping change; then write_allocating maps again.
Task<Result<bool>> Qcow2Writer::write_in_place(GuestOffset guest, std::span<const std::byte> buf) {
  const uint64_t cs = img_.geometry.cluster_size();
  auto range = co_await reads_.ranges().lock(align_down(guest, cs), align_up(guest + buf.size(), cs),
                                             io::RangeLock::Mode::shared);
  Plan plan;
  auto all_overwrites = co_await map_overwrite(guest, buf.size(), plan);
  if (!all_overwrites) co_return all_overwrites.status();
  if (!*all_overwrites) co_return false;
  QCOWFS_CO_TRY(co_await write_data(plan, guest, buf));
  co_return true;
}

// The exclusive pass: one mapping under the exclusive range lock and the
// metadata lock, which no other mapping change can pass.
Task<Status> Qcow2Writer::write_allocating(GuestOffset guest, std::span<const std::byte> buf) {
  const uint64_t cs = img_.geometry.cluster_size();
  auto range = co_await reads_.ranges().lock(align_down(guest, cs), align_up(guest + buf.size(), cs),
                                             io::RangeLock::Mode::exclusive);
  Plan plan;
  bool compressing = false;
  {
    auto m = co_await meta_.lock();
    auto map_and_allocate = [&]() -> Task<Status> {
      QCOWFS_CO_TRY(co_await map_exclusive(guest, buf.size(), plan));
      compressing = mark_compressible(plan);
      if (compressing) co_return Status::ok();  // allocated once compressed
      co_return co_await allocate_run(plan);
    };
    QCOWFS_CO_TRY(co_await with_refcount_room(m, map_and_allocate));
  }
  if (compressing) QCOWFS_CO_TRY(co_await compress_and_allocate(plan, guest, buf));
  Status st = co_await fill_cow(plan, guest, buf);
  if (st) st = co_await write_data(plan, guest, buf);
  auto m = co_await meta_.lock();
  tracker_.data_written();
  if (!st) {
    Status u = co_await undo(plan);
    if (!u) log::error("{}: releasing clusters of a failed write: {}", img_.path, u.message());
    co_return st;
  }
  co_return co_await commit(plan);
}

// The old contents around the request in every slot that writes more than
// the request covers, with the request copied in.
Task<Status> Qcow2Writer::fill_cow(Plan& plan, GuestOffset start, std::span<const std::byte> buf) {
  const uint64_t cs = img_.geometry.cluster_size();
  const uint64_t disk = size();
  for (Slot& s : plan.slots) {
    if (s.kind == Kind::overwrite || s.kind == Kind::compressed || !s.needs_cow()) continue;
    s.cow = io::AlignedBuffer(static_cast<size_t>(s.wr_end - s.wr_start), img_.data_file->mem_align(), true);
    const GuestOffset guest = s.gc * cs + s.wr_start;
    const uint64_t n = guest < disk && !s.fresh ? std::min(s.wr_end - s.wr_start, disk - guest) : 0;
    if (n > 0) QCOWFS_CO_TRY(co_await reads_.read_unlocked(guest, s.cow.span().first(static_cast<size_t>(n))));
    std::memcpy(s.cow.data() + (s.rq_start - s.wr_start), buf.data() + (s.gc * cs + s.rq_start - start),
                static_cast<size_t>(s.rq_end - s.rq_start));
  }
  co_return Status::ok();
}

// QEMU's overlap check: guest data must never land on metadata. Returns the
// metadata range [host, host + len) overlaps, or null.
const MetadataRange* Qcow2Writer::data_overlap(HostOffset host, uint64_t len) const {
  if (img_.header.has_external_data_file()) return nullptr;
  const MetadataRange* m = img_.layout.overlap(host, len);
  // The layout is taken at open; the writer moves the L1 and refcount
  // tables when they grow and frees the old ones, which may then hold data.
  // Called without the metadata lock (pure overwrites never take it). The L1
  // table moves only with the whole guest range locked exclusive, which our
  // range lock excludes; the refcount table moves under the metadata lock
  // alone, so its offset is an atomic (RefcountTable::table_offset): a reused
  // old-table cluster was handed out after the move was published.
  if (m && ((m->what == "L1 table" && m->start != l1_.host_offset) ||
            (m->what == "refcount table" && m->start != refcounts_->table_offset())))
    return nullptr;
  return m;
}

Task<Status> Qcow2Writer::data_overlap_error(GuestOffset guest, HostOffset host, const MetadataRange& m) {
  co_return co_await img_.signal_corruption(
      fmt::format("guest write at {:#x} maps to host {:#x}, inside the {} at {:#x}", guest, host, m.what, m.start));
}

// Not a coroutine: the common small write returns the host write's task itself.
Task<Status> Qcow2Writer::write_data(Plan& plan, GuestOffset guest, std::span<const std::byte> buf) {
  if (plan.slots.size() == 1 && plan.slots[0].cow.empty() && plan.slots[0].kind != Kind::compressed) {
    // the common small write: no vectors
    const Slot& s = plan.slots[0];
    const HostOffset host = s.host + s.wr_start;
    if (const MetadataRange* m = data_overlap(host, s.rq_end - s.rq_start)) return data_overlap_error(guest, host, *m);
    return img_.data_io->write(host, buf);
  }
  return write_runs(plan, guest, buf);
}

// The plan as one write per host-contiguous run (and one per compressed stream), in parallel.
Task<Status> Qcow2Writer::write_runs(Plan& plan, GuestOffset guest, std::span<const std::byte> buf) {
  std::vector<HostWrite> runs = host_writes(plan, guest, buf);
  std::vector<io::AlignedBuffer> packed;
  std::vector<HostWrite> streams = compressed_writes(plan, packed);
  for (const std::vector<HostWrite>* list : {&runs, &streams})
    for (const HostWrite& r : *list)
      if (const MetadataRange* m = data_overlap(r.host, r.len)) co_return co_await data_overlap_error(guest, r.host, *m);
  std::vector<Task<Status>> writes;
  writes.reserve(runs.size() + streams.size());
  io::HostFile& f = *img_.data_io;
  for (HostWrite& r : runs) {
    if (r.iov.size() == 1)
      writes.push_back(f.write(r.host, std::span<const std::byte>(static_cast<const std::byte*>(r.iov[0].iov_base), r.len)));
    else
      writes.push_back(f.writev(r.host, r.iov));
  }
  // Compressed streams live in the image file (never encrypted, never in an
  // external data file: check_compress_allowed).
  for (HostWrite& r : streams)
    writes.push_back(img_.file->write(r.host, std::span<const std::byte>(static_cast<const std::byte*>(r.iov[0].iov_base), r.len)));
  co_return co_await io::when_all(std::move(writes));
}

// The plan's slots as host-contiguous runs, each slot's bytes the request
// (buf, starting at guest offset start) or its COW buffer.
std::vector<Qcow2Writer::HostWrite> Qcow2Writer::host_writes(Plan& plan, GuestOffset start,
                                                         std::span<const std::byte> buf) const {
  const uint64_t cs = img_.geometry.cluster_size();
  std::vector<HostWrite> runs;
  for (Slot& s : plan.slots) {
    if (s.kind == Kind::compressed) continue;  // compressed_writes
    iovec v;
    if (s.cow.empty()) {
      v.iov_base = const_cast<std::byte*>(buf.data() + (s.gc * cs + s.rq_start - start));
      v.iov_len = static_cast<size_t>(s.rq_end - s.rq_start);
    } else {
      v.iov_base = s.cow.data();
      v.iov_len = s.cow.size();
    }
    const HostOffset host = s.host + s.wr_start;
    if (runs.empty() || runs.back().host + runs.back().len != host) {
      runs.push_back(HostWrite{host, v.iov_len, {v}});
      continue;
    }
    HostWrite& r = runs.back();
    iovec& prev = r.iov.back();
    if (static_cast<std::byte*>(prev.iov_base) + prev.iov_len == static_cast<std::byte*>(v.iov_base))
      prev.iov_len += v.iov_len;
    else
      r.iov.push_back(v);
    r.len += v.iov_len;
  }
  return runs;
}

}  // namespace qcowfs::image::qcow2
