// ExtentDriver's zeroing: write_zeroes and discard, zeroing data in place,
// unmapping whole units (and punching their host space), the writer's zero
// state for units over a backing image, and compaction (VDI). The rules are in
// image/extent/driver.h and image/extent/writer.h.
#include <algorithm>
#include <cstring>

#include "image/extent/driver.h"
#include "io/align.h"
#include "io/buffer.h"
#include "io/log.h"

namespace qcowfs::image {
namespace {

// Zeros written through the allocating path are written in pieces of this size.
constexpr uint64_t kZeroChunk = 1 << 20;

}  // namespace

Task<Status> ExtentDriver::write_zeroes(uint64_t off, uint64_t len, bool may_unmap) {
  if (img_.writer == nullptr) co_return refuse_write();
  if (len > 0) QCOWFS_CO_TRY(co_await first_write());
  const uint64_t end = off + len;
  uint64_t guest = off;
  while (guest < end) {
    InFlightIo::Ticket ticket = track();  // a data extent is zeroed without the lock
    auto e = co_await extent_at(guest, end - guest);
    if (!e) co_return e.status();
    auto done = co_await write_zero_extent(*e, guest, may_unmap, ticket);
    if (!done) co_return done.status();
    guest += *done;
  }
  co_return Status::ok();
}

// Extent e at guest zeroed, or its first part: returns the bytes done (the
// rest is looked up again). Data is zeroed in the host file (zero_data), or
// its whole units unmapped where the writer can (unmap_extent); ranges that
// read as zeros already are left; the rest (backing data, compressed units)
// is overwritten with zeros. The lookup's ticket is left before anything that
// takes the allocation lock.
Task<Result<uint64_t>> ExtentDriver::write_zero_extent(const Extent& e, uint64_t guest, bool unmap,
                                                       InFlightIo::Ticket& ticket) {
  if (e.kind != ExtentKind::data) ticket.leave();
  if (reads_zero(e, guest)) co_return e.length;
  if (e.kind == ExtentKind::unallocated) {
    QCOWFS_CO_TRY(co_await zero_units(guest, e.length, unmap));
  } else if (e.kind != ExtentKind::data) {
    QCOWFS_CO_TRY(co_await write_zero_buffer(guest, e.length));
  } else if (unmap && unmaps_) {
    co_return co_await unmap_extent(e, guest, ticket);
  } else {
    QCOWFS_CO_TRY(co_await zero_data(e, guest, e.length, unmap, ticket));
  }
  co_return e.length;
}

// The first len bytes of data extent e (at guest) zeroed in place, lock-free
// under the lookup's ticket; where the writer must see the write first
// (before_unit_write, a unit being moved) under the lock instead.
Task<Status> ExtentDriver::zero_data(const Extent& e, uint64_t guest, uint64_t len, bool unmap,
                                     InFlightIo::Ticket& ticket) {
  if (needs_before_unit_writes(guest, len)) {
    ticket.leave();
    co_return co_await zero_data_locked(guest, len, unmap);
  }
  co_return co_await zero_host(*e.file, e.host_offset, len, unmap);
}

// Guest bytes [guest, guest + len), data when looked up without the lock,
// zeroed under the allocation lock after before_unit_writes(), looked up
// again there (a compaction may have moved them). Bytes that stopped being
// data and do not read as zeros are zeroed as they are now, after the lock.
Task<Status> ExtentDriver::zero_data_locked(uint64_t guest, uint64_t len, bool unmap) {
  std::vector<std::pair<uint64_t, uint64_t>> other;  // guest offset, length
  {
    auto lock = co_await alloc_.lock();
    QCOWFS_CO_TRY(co_await before_unit_writes(guest, len));
    for (uint64_t at = guest; at < guest + len;) {
      auto e = co_await extent_at(at, guest + len - at);
      if (!e) co_return e.status();
      if (e->kind == ExtentKind::data) {
        QCOWFS_CO_TRY(co_await zero_host(*e->file, e->host_offset, e->length, unmap));
      } else if (!reads_zero(*e, at)) {
        other.emplace_back(at, e->length);
      }
      at += e->length;
    }
  }
  for (const auto& [at, n] : other) QCOWFS_CO_TRY(co_await write_zeroes(at, n, unmap));
  co_return Status::ok();
}

// Host bytes zeroed: punched where allowed and the host reads holes as zeros
// (files), else zeroed by the host.
Task<Status> ExtentDriver::zero_host(io::HostFile& file, uint64_t host, uint64_t len, bool unmap) {
  if (unmap && !file.is_block_device()) co_return co_await file.discard(host, len);
  co_return co_await file.write_zeroes(host, len);
}

// Data extent e at guest, zeroed with unmap allowed by a writer that unmaps:
// its whole units unmapped (a unit the disk's end cuts counts as whole when
// the extent reaches that end), a partial unit at the start zeroed in place.
// Returns the bytes done: the partial unit at the start, or everything up to
// the end of the whole units (a partial unit at the end is looked up again:
// the unmap may have moved it).
Task<Result<uint64_t>> ExtentDriver::unmap_extent(const Extent& e, uint64_t guest, InFlightIo::Ticket& ticket) {
  const uint64_t us = img_.writer->unit_size();
  const uint64_t end = guest + e.length;
  const uint64_t first = (guest + us - 1) / us;
  const uint64_t last = end == size() ? (end + us - 1) / us : end / us;
  uint64_t done = e.length;
  if (first < last) done = first * us > guest ? first * us - guest : std::min(last * us, end) - guest;
  if (first >= last || first * us > guest) {
    QCOWFS_CO_TRY(co_await zero_data(e, guest, done, true, ticket));
    co_return done;
  }
  ticket.leave();  // unmap_units takes the allocation lock
  QCOWFS_CO_TRY(co_await unmap_units(first, last));
  co_return done;
}

// Under the allocation lock, each of units [first, last) that is still one
// whole data extent is prepared and unmapped (ExtentWriter::unmap); then its
// host space is compacted (compact()) or punched and kept for recycling
// (punch_unmapped()), also when a later unit failed. Units another request
// changed meanwhile are zeroed as they are now, after the lock.
Task<Status> ExtentDriver::unmap_units(uint64_t first, uint64_t last) {
  const uint64_t us = img_.writer->unit_size();
  std::vector<uint64_t> changed;
  {
    auto lock = co_await alloc_.lock();
    // A compaction moves the last allocated units: none may be in flight.
    if (img_.writer->compacts()) co_await quiesce(lock);
    if (!changed_) {
      QCOWFS_CO_TRY(co_await img_.writer->begin_change());
      changed_ = true;
    }
    std::vector<HostRun> runs;  // the unmapped units' host space, contiguous runs merged
    Status failed = co_await unmap_each(first, last, runs, changed);
    if (!runs.empty()) {
      Status freed = Status::ok();
      if (img_.writer->compacts()) {
        freed = co_await compact(runs);
      } else {
        freed = co_await punch_unmapped(runs);
      }
      if (failed.is_ok()) failed = std::move(freed);
    }
    if (!failed) co_return failed;
  }
  for (uint64_t u : changed) QCOWFS_CO_TRY(co_await write_zeroes(u * us, std::min(us, size() - u * us), true));
  co_return Status::ok();
}

// unmap_units' loop (alloc_ held): the units unmapped go into runs, those
// that are no longer one whole data extent (and hold other than zeros) into
// changed. Stops at the first failure.
Task<Status> ExtentDriver::unmap_each(uint64_t first, uint64_t last, std::vector<HostRun>& runs,
                                      std::vector<uint64_t>& changed) {
  const uint64_t us = img_.writer->unit_size();
  const uint64_t prefix = img_.writer->unit_prefix().size();
  const uint64_t stride = img_.writer->unit_stride();
  for (uint64_t u = first; u < last; ++u) {
    const uint64_t len = std::min(us, size() - u * us);
    auto e = co_await extent_at(u * us, len);
    if (!e) co_return e.status();
    if (e->kind != ExtentKind::data || e->length != len || e->host_offset < prefix) {
      if (!reads_zero(*e, u * us)) changed.push_back(u);
      continue;
    }
    QCOWFS_CO_TRY(co_await img_.writer->prepare(u, 1));
    img_.writer->unmap(u, 1);
    const uint64_t host = e->host_offset - prefix;
    HostRun* run = runs.empty() ? nullptr : &runs.back();
    if (run && run->file == e->file && run->host + run->units * stride == host) {
      ++run->units;
    } else {
      runs.push_back(HostRun{e->file, host, 1, false});
    }
  }
  co_return Status::ok();
}

// Unmapped space punched (the entries no longer name it, so its bytes need
// not read as zeros: block devices get a discard too) and kept in unmapped_
// until recycle_drained() (alloc_ held).
Task<Status> ExtentDriver::punch_unmapped(const std::vector<HostRun>& runs) {
  const uint64_t stride = img_.writer->unit_stride();
  const uint64_t epoch = in_flight_.epoch();  // after every unmap() store
  for (const HostRun& run : runs) unmapped_.push_back(Unmapped{run, epoch, false});
  Status failed = Status::ok();
  for (const HostRun& run : runs) {
    Status st = co_await run.file->discard(run.host, run.units * stride);
    if (!st && failed) failed = st.with_context(img_.path);
  }
  co_return failed;
}

// The writer's compaction of units just unmapped (alloc_ held, so no
// allocation, write-back or other compaction runs meanwhile):
//   1. begin_compaction(): the moves; in-place writes into a moving unit
//      now go through the lock (needs_before_unit_write);
//   2. where something moves, a grace period: every lock-free I/O that found
//      an unmapped unit's place (which a move fills now) has completed, and
//      so has every in-place write that checked a moving unit before step 1;
//   3. the data copied and flushed: durable before an entry names it;
//   4. commit_compaction(), written back and flushed at once: no vacated
//      place takes new data while an entry on disk may still name it;
//   5. a grace period: every I/O that found a moved unit's old place, or an
//      unmapped unit's place at the end, has completed; end_compaction() lets
//      writes into the moved units go lock-free again and gives the vacated
//      space at the end back.
// So an in-place write that found a moving unit's old place either checked
// it before step 1 (and was waited for in step 2: the copy holds its bytes)
// or saw it moving (the flag stays until after step 5, which waits for it).
// A failure in step 3 cancels: the unmapped units' space is zeroed (it may
// hold part of a moved unit now) and their entries restored.
Task<Status> ExtentDriver::compact(const std::vector<HostRun>& unmapped) {
  const std::vector<UnitMove> moves = img_.writer->begin_compaction();
  if (!moves.empty()) co_await grace_period(in_flight_.epoch());
  Status st = co_await copy_units(moves);
  if (st) st = co_await flush_files();
  if (!st) {
    const uint64_t stride = img_.writer->unit_stride();
    for (const HostRun& run : unmapped) (void)co_await zero_host(*run.file, run.host, run.units * stride, true);
    img_.writer->cancel_compaction();
    co_return st.with_context(img_.path);
  }
  img_.writer->commit_compaction();
  Status written = co_await img_.writer->write_metadata();
  if (written) written = co_await flush_files();
  if (!written) log::error("{}: writing back {} metadata: {}", img_.path, img_.format, written.message());
  co_await grace_period(in_flight_.epoch());
  Status ended = co_await img_.writer->end_compaction(written.is_ok());
  if (!written) co_return written;
  co_return ended.is_ok() ? ended : ended.with_context(img_.path);
}

// Each move's bytes read from its old place and written to its new one.
Task<Status> ExtentDriver::copy_units(const std::vector<UnitMove>& moves) {
  if (moves.empty()) co_return Status::ok();
  io::AlignedBuffer buf(static_cast<size_t>(img_.writer->unit_stride()), mem_align(), false);
  for (const UnitMove& m : moves) {
    auto n = co_await m.from.file->read(m.from.host, buf.span());
    if (!n) co_return n.status();
    if (*n < buf.size()) std::memset(buf.data() + *n, 0, buf.size() - *n);
    QCOWFS_CO_TRY(co_await m.to.file->write(m.to.host, buf.span()));
  }
  co_return Status::ok();
}

// Unallocated bytes over a backing image: the whole units among them take the
// format's zero state where it has one (ExtentWriter::mark_zero, nothing
// allocated or written), the rest is written with zeros. Units another
// request allocated meanwhile are zeroed as data.
Task<Status> ExtentDriver::zero_units(uint64_t guest, uint64_t len, bool unmap) {
  const uint64_t us = img_.writer->unit_size();
  const uint64_t end = guest + len;
  const uint64_t first = (guest + us - 1) / us;
  // A unit that the disk's end cuts counts as whole when the range reaches that end.
  const uint64_t last = end == size() ? (end + us - 1) / us : end / us;
  if (first >= last || !img_.writer->has_zero_state(first)) co_return co_await write_zero_buffer(guest, len);
  if (first * us > guest) QCOWFS_CO_TRY(co_await write_zero_buffer(guest, first * us - guest));
  std::vector<uint64_t> allocated;
  {
    auto lock = co_await alloc_.lock();
    // A unit being allocated is zeroed once it is published.
    while (Event busy = pending(first, last - first)) {
      lock.release();
      co_await busy->wait();
      lock = co_await alloc_.lock();
    }
    if (!changed_) {
      QCOWFS_CO_TRY(co_await img_.writer->begin_change());
      changed_ = true;
    }
    for (uint64_t u = first; u < last; ++u) {
      auto e = co_await extent_at(u * us, std::min(us, size() - u * us));
      if (!e) co_return e.status();
      if (e->kind != ExtentKind::unallocated || !img_.writer->has_zero_state(u)) {
        allocated.push_back(u);
        continue;
      }
      QCOWFS_CO_TRY(co_await img_.writer->prepare(u, 1));
      img_.writer->mark_zero(u, 1);
    }
  }
  for (uint64_t u : allocated) QCOWFS_CO_TRY(co_await write_zeroes(u * us, std::min(us, size() - u * us), unmap));
  if (last * us < end) QCOWFS_CO_TRY(co_await write_zero_buffer(last * us, end - last * us));
  co_return Status::ok();
}

Task<Status> ExtentDriver::write_zero_buffer(uint64_t guest, uint64_t len) {
  io::AlignedBuffer zeros(static_cast<size_t>(std::min(len, kZeroChunk)), mem_align(), true);
  for (uint64_t done = 0; done < len;) {
    const uint64_t n = std::min(len - done, kZeroChunk);
    QCOWFS_CO_TRY(co_await write(guest + done, zeros.span().first(n)));
    done += n;
  }
  co_return Status::ok();
}

Task<Status> ExtentDriver::discard(uint64_t off, uint64_t len) { co_return co_await write_zeroes(off, len, true); }

}  // namespace qcowfs::image
