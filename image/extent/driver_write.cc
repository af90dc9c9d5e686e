// ExtentDriver's write side: planning a write, in-place writes, and
// allocating writes (batches) with their copy-on-write merged into one host
// write per run. Zeroing, unmapping and compaction are in driver_zero.cc;
// metadata writeback, grace periods, growth, flush and close in
// driver_flush.cc. The rules are in image/extent/driver.h and
// image/extent/writer.h.
#include <sys/uio.h>

#include <algorithm>
#include <array>
#include <cstring>

#include "image/extent/driver.h"
#include "io/align.h"
#include "io/buffer.h"
#include "io/engine.h"
#include "io/log.h"
#include "io/when_all.h"

namespace qcowfs::image {
namespace {

iovec iov_of(std::span<const std::byte> s) {
  return iovec{const_cast<std::byte*>(s.data()), s.size()};  // NOLINT: writev takes non-const iovecs
}

}  // namespace

// One in-place host write of a request.
struct ExtentDriver::SubWrite {
  io::HostFile* file = nullptr;
  uint64_t host = 0;
  uint64_t guest = 0;
  std::span<const std::byte> src;
};

// A guest-contiguous run of unallocated or zero units that a request writes:
// [first_unit, first_unit + units) get new host space; the request covers
// [guest, guest + src.size()) of them, head and tail hold the old bytes of the
// rest (copy-on-write).
struct ExtentDriver::Allocation {
  uint64_t first_unit = 0;
  uint64_t units = 0;
  uint64_t guest = 0;
  std::span<const std::byte> src;
  bool old_zero = true;  // the units' old contents read as zeros
  HostRun run;
  uint64_t head_len = 0;   // bytes of the first unit before the request
  uint64_t tail_len = 0;   // bytes of the last unit after it
  io::AlignedBuffer head;  // their old bytes (empty while old_zero: see write_allocation)
  io::AlignedBuffer tail;
};

// An allocating request in flight (write_allocating): its host writes, and
// how it ended. settled is set once it is published, has failed, or must be
// done again; requests for its units wait for it.
struct ExtentDriver::Batch {
  enum class State { writing, written, failed, published, retry };
  std::vector<SubWrite> in_place;
  std::vector<Allocation> allocs;
  State state = State::writing;
  Status result = Status::ok();
  Event settled = std::make_shared<io::AsyncEvent>();
  // The batch whose reserved space some of in_place's writes go into (ride()):
  // this one is done only once that one is published.
  std::shared_ptr<Batch> rides;
};

// Whether extent e at guest offset guest reads as zeros.
bool ExtentDriver::reads_zero(const Extent& e, uint64_t guest) const {
  if (e.kind == ExtentKind::zero) return true;
  if (e.kind != ExtentKind::unallocated) return false;
  return img_.backing == nullptr || guest >= img_.backing->size();
}

// Without the allocation lock when every unit is allocated and the writer
// need not see the write first: the host writes of a request issued together.
// Otherwise planned again under the lock, where nothing is unmapped or moved
// (the ticket is left first: a compaction holding the lock may be waiting for
// it). A unit that a compaction starts to move after the check above is not
// copied before this write completed, nor given its new place before every
// such write completed (ExtentDriver::compact).
Task<Status> ExtentDriver::write(uint64_t off, std::span<const std::byte> buf) {
  if (img_.writer == nullptr) co_return refuse_write();
  if (buf.empty()) co_return Status::ok();
  QCOWFS_CO_TRY(co_await first_write());
  InFlightIo::Ticket ticket = track();  // until the host writes completed
  std::vector<SubWrite> in_place;
  std::vector<Allocation> allocs;
  QCOWFS_CO_TRY(co_await plan_write(off, buf, in_place, allocs));
  if (!allocs.empty() || needs_before_unit_writes(off, buf.size())) {
    ticket.leave();
    co_return co_await write_allocating(off, buf);
  }
  co_return co_await write_in_place(in_place);
}

Task<Status> ExtentDriver::write_in_place(const std::vector<SubWrite>& in_place) {
  if (in_place.size() == 1)
    co_return co_await in_place.front().file->write(in_place.front().host, in_place.front().src);
  std::vector<Task<Status>> tasks;
  tasks.reserve(in_place.size());
  for (const SubWrite& w : in_place) tasks.push_back(w.file->write(w.host, w.src));
  co_return co_await io::when_all(std::move(tasks));
}

// Whether a unit of [guest, guest + len) needs ExtentWriter::before_unit_write
// (one atomic load a unit, no lock).
bool ExtentDriver::needs_before_unit_writes(uint64_t guest, uint64_t len) const {
  const uint64_t us = img_.writer->unit_size();
  for (uint64_t u = guest / us; u * us < guest + len; ++u)
    if (img_.writer->needs_before_unit_write(u)) return true;
  return false;
}

// ExtentWriter::before_unit_write for the allocated units of [guest, guest +
// len) that need it (alloc_ held).
Task<Status> ExtentDriver::before_unit_writes(uint64_t guest, uint64_t len) {
  const uint64_t us = img_.writer->unit_size();
  for (uint64_t u = guest / us; u * us < guest + len; ++u) {
    if (!img_.writer->needs_before_unit_write(u)) continue;
    auto e = co_await extent_at(u * us, std::min(us, size() - u * us));
    if (!e) co_return e.status();
    if (e->kind != ExtentKind::data) continue;  // only allocated units are written in place
    Status st = co_await img_.writer->before_unit_write(u);
    if (!st) co_return st.with_context(img_.path);
  }
  co_return Status::ok();
}

// Splits [start, start + buf.size()) into in-place writes (data extents,
// coalesced where host-contiguous) and allocations (runs of other extents,
// widened to whole units).
Task<Status> ExtentDriver::plan_write(uint64_t start, std::span<const std::byte> buf, std::vector<SubWrite>& in_place,
                                      std::vector<Allocation>& allocs) {
  const uint64_t end = start + buf.size();
  const uint64_t us = img_.writer->unit_size();
  uint64_t guest = start;
  while (guest < end) {
    auto e = co_await extent_at(guest, end - guest);
    if (!e) co_return e.status();
    std::span<const std::byte> src = buf.subspan(guest - start, e->length);
    if (e->kind == ExtentKind::data) {
      SubWrite* last = in_place.empty() ? nullptr : &in_place.back();
      if (last && last->file == e->file && last->host + last->src.size() == e->host_offset &&
          last->src.data() + last->src.size() == src.data()) {
        last->src = std::span<const std::byte>(last->src.data(), last->src.size() + src.size());
      } else {
        in_place.push_back(SubWrite{e->file, e->host_offset, guest, src});
      }
    } else {
      Allocation* last = allocs.empty() ? nullptr : &allocs.back();
      if (last && last->guest + last->src.size() == guest) {
        last->src = std::span<const std::byte>(last->src.data(), last->src.size() + src.size());
        last->old_zero = last->old_zero && reads_zero(*e, guest);
      } else {
        allocs.push_back(Allocation{});
        allocs.back().guest = guest;
        allocs.back().src = src;
        allocs.back().old_zero = reads_zero(*e, guest);
      }
    }
    guest += e->length;
  }
  for (size_t i = 0; i < allocs.size(); ++i) {
    Allocation& a = allocs[i];
    a.first_unit = a.guest / us;
    a.units = (a.guest + a.src.size() + us - 1) / us - a.first_unit;
    const uint64_t limit = std::max<uint64_t>(1, img_.writer->run_limit(a.first_unit));
    if (a.units <= limit) continue;
    // The rest goes into a run of its own (another file's units).
    Allocation rest;
    rest.guest = (a.first_unit + limit) * us;
    rest.src = a.src.subspan(rest.guest - a.guest);
    rest.old_zero = a.old_zero;
    a.src = a.src.first(rest.guest - a.guest);
    a.units = limit;
    allocs.insert(allocs.begin() + static_cast<ptrdiff_t>(i) + 1, std::move(rest));
  }
  co_return Status::ok();
}

// ExtentWriter::before_first_write(), once per open, before any change.
Task<Status> ExtentDriver::first_write() {
  if (written_.load(std::memory_order_acquire)) co_return Status::ok();
  auto lock = co_await alloc_.lock();
  co_return co_await first_write_locked();
}

Task<Status> ExtentDriver::first_write_locked() {
  if (written_.load(std::memory_order_acquire)) co_return Status::ok();
  Status st = co_await img_.writer->before_first_write();
  if (!st) co_return st.with_context(img_.path);
  written_.store(true, std::memory_order_release);
  co_return Status::ok();
}

// A request that allocates, or writes into units the writer must see first,
// as one batch: planned again under the allocation lock (another request may
// have allocated some of its units meanwhile, a compaction moved them), its
// new units' space reserved there; every host write issued together without
// the lock (in-place ones too: no unit moves while a batch is in flight, see
// quiesce()); then published under the lock, in reservation order (settle()).
// A batch given back because an earlier one failed is done again.
Task<Status> ExtentDriver::write_allocating(uint64_t off, std::span<const std::byte> buf) {
  for (;;) {
    auto batch = std::make_shared<Batch>();
    InFlightIo::Ticket ticket;
    {
      auto lock = co_await alloc_.lock();
      auto wait = co_await begin_batch(off, buf, *batch);
      if (!wait) co_return wait.status();
      if (*wait) {
        lock.release();
        co_await (*wait)->wait();
        continue;
      }
      // Entered before the lock goes: a discard from now on waits for these
      // host writes before it hands out the space they found.
      ticket = track();
      batches_.push_back(batch);
    }
    Status st = co_await write_batch(*batch);
    ticket.leave();  // before waiting for the lock, which a grace period may hold
    {
      auto lock = co_await alloc_.lock();
      // A failure gives back every later batch: hold new ones until then.
      if (!st && !batch->allocs.empty() && !gate_) gate_ = std::make_shared<io::AsyncEvent>();
      batch->state = st ? Batch::State::written : Batch::State::failed;
      batch->result = std::move(st);
      settle();
    }
    co_await batch->settled->wait();
    if (batch->state == Batch::State::retry) continue;
    if (batch->rides && batch->result) {
      co_await batch->rides->settled->wait();
      if (batch->rides->state != Batch::State::published) continue;  // its space was given back
    }
    co_return batch->result;
  }
}

// Under the allocation lock: b planned, its new units prepared and their
// space reserved (returns no event); or the event to wait for before trying
// again: new batches are held (gate_), or another batch is allocating one of
// b's units.
Task<Result<ExtentDriver::Event>> ExtentDriver::begin_batch(uint64_t off, std::span<const std::byte> buf, Batch& b) {
  if (gate_) co_return gate_;
  QCOWFS_CO_TRY(co_await first_write_locked());
  QCOWFS_CO_TRY(co_await plan_write(off, buf, b.in_place, b.allocs));
  for (size_t i = 0; i < b.allocs.size();) {
    auto [owner, space] = pending_allocation(b.allocs[i].first_unit, b.allocs[i].units);
    if (owner == nullptr) {
      ++i;
      continue;
    }
    if (!can_ride(*space, b.allocs[i]) || (b.rides && b.rides != owner)) co_return owner->settled;
    ride(*space, b.allocs[i], b.in_place);
    b.rides = owner;
    b.allocs.erase(b.allocs.begin() + static_cast<ptrdiff_t>(i));
  }
  if (!changed_ && !b.allocs.empty()) {
    QCOWFS_CO_TRY(co_await img_.writer->begin_change());
    changed_ = true;
  }
  for (Allocation& a : b.allocs) {
    QCOWFS_CO_TRY(co_await fill_cow(a));
    QCOWFS_CO_TRY(co_await img_.writer->prepare(a.first_unit, a.units));
  }
  for (const SubWrite& w : b.in_place)
    if (needs_before_unit_writes(w.guest, w.src.size()))
      QCOWFS_CO_TRY(co_await before_unit_writes(w.guest, w.src.size()));
  recycle_drained();
  QCOWFS_CO_TRY(co_await reserve_all(b.allocs));
  co_return Event{};
}

// Every host write of a batch, issued together.
Task<Status> ExtentDriver::write_batch(Batch& b) {
  std::vector<Task<Status>> tasks;
  tasks.reserve(b.in_place.size() + b.allocs.size());
  for (const SubWrite& w : b.in_place) tasks.push_back(w.file->write(w.host, w.src));
  for (Allocation& a : b.allocs) tasks.push_back(write_allocation(a));
  co_return co_await io::when_all(std::move(tasks));
}

// The batch in flight, and its allocation, that allocates one of units
// [first, first + n) (nullptr: none). alloc_ held.
std::pair<std::shared_ptr<ExtentDriver::Batch>, const ExtentDriver::Allocation*> ExtentDriver::pending_allocation(
    uint64_t first, uint64_t n) const {
  for (const auto& b : batches_)
    for (const Allocation& x : b->allocs)
      if (x.first_unit < first + n && first < x.first_unit + x.units) return {b, &x};
  return {nullptr, nullptr};
}

// The settled event of that batch, or none (alloc_ held).
ExtentDriver::Event ExtentDriver::pending(uint64_t first, uint64_t n) const {
  auto owner = pending_allocation(first, n).first;
  return owner ? owner->settled : nullptr;
}

// Whether a, planned over units that allocation `space` of a batch in flight
// is allocating, can be written straight into the space reserved for them
// instead of waiting for its publication: all of a's units are among
// space's, their old bytes are zeros, and a's bytes are ones that space's
// host writes leave out (fresh space: everything around its request).
bool ExtentDriver::can_ride(const Allocation& space, const Allocation& a) const {
  if (a.first_unit < space.first_unit || a.first_unit + a.units > space.first_unit + space.units) return false;
  if (!space.old_zero || !space.run.fresh) return false;
  return a.guest >= space.guest + space.src.size() || a.guest + a.src.size() <= space.guest;
}

// a's bytes as in-place writes into the space reserved by `space`, one per
// unit (units of a run are a stride apart, each after its prefix).
void ExtentDriver::ride(const Allocation& space, const Allocation& a, std::vector<SubWrite>& out) const {
  const uint64_t us = img_.writer->unit_size();
  const uint64_t prefix = img_.writer->unit_prefix().size();
  const uint64_t stride = img_.writer->unit_stride();
  for (uint64_t guest = a.guest; guest < a.guest + a.src.size();) {
    const uint64_t unit = guest / us;
    const uint64_t n = std::min(a.guest + a.src.size(), (unit + 1) * us) - guest;
    const uint64_t host = space.run.host + (unit - space.first_unit) * stride + prefix + guest % us;
    out.push_back(SubWrite{space.run.file, host, guest, a.src.subspan(guest - a.guest, n)});
    guest += n;
  }
}

// Publishes the batches at the head of batches_ that have been written, in
// reservation order; those that allocate nothing settle as soon as they are
// done, with their result. Once a failed batch is at the head and no later
// one is still writing, all of them are given back (roll_back()). alloc_ held.
void ExtentDriver::settle() {
  // Batches that allocate nothing hold no place in the order: done, they go.
  std::erase_if(batches_, [](const std::shared_ptr<Batch>& b) {
    if (!b->allocs.empty() || b->state == Batch::State::writing) return false;
    b->settled->set();
    return true;
  });
  while (!batches_.empty()) {
    Batch& b = *batches_.front();
    if (b.state == Batch::State::failed) break;
    if (b.state == Batch::State::writing) return;
    for (const Allocation& a : b.allocs) img_.writer->publish(a.first_unit, a.run);
    b.state = Batch::State::published;
    b.settled->set();
    batches_.pop_front();
  }
  if (!batches_.empty()) {
    for (const auto& b : batches_)
      if (b->state == Batch::State::writing) return;
    roll_back();
  }
  if (drained_) std::exchange(drained_, nullptr)->set();
  if (quiescers_ == 0) open_gate();
}

// The batch at the head failed and every later one has been written or has
// failed: their space is given back newest first (so that each unreserve()
// gives back the writer's latest reservation, and VDI's block numbers stay
// without gaps). The failed ones return their error, the others are done
// again. alloc_ held.
void ExtentDriver::roll_back() {
  for (auto it = batches_.rbegin(); it != batches_.rend(); ++it) {
    Batch& b = **it;
    for (auto a = b.allocs.rbegin(); a != b.allocs.rend(); ++a) img_.writer->unreserve(a->run);
    if (b.state == Batch::State::written) b.state = Batch::State::retry;
  }
  for (const auto& b : batches_) b->settled->set();
  batches_.clear();
}

// Takes the allocation lock once no batch is in flight: new batches wait
// meanwhile (gate_) and those in flight publish. For whatever must not see
// space reserved whose entry is not published (metadata writeback, growth, a
// compaction, close). On return `lock` holds the lock with batches_ empty.
Task<void> ExtentDriver::quiesce(io::AsyncMutex::Guard& lock) {
  ++quiescers_;
  while (!batches_.empty()) {
    if (!gate_) gate_ = std::make_shared<io::AsyncEvent>();
    if (!drained_) drained_ = std::make_shared<io::AsyncEvent>();
    Event drained = drained_;
    lock.release();
    co_await drained->wait();
    lock = co_await alloc_.lock();
  }
  if (--quiescers_ == 0) open_gate();  // nothing in flight: no failure left to give back either
}

// New batches may go on (alloc_ held).
void ExtentDriver::open_gate() {
  if (gate_) std::exchange(gate_, nullptr)->set();
}

// Host space for every allocation, in order; on failure the ones already
// reserved are given back (newest first).
Task<Status> ExtentDriver::reserve_all(std::vector<Allocation>& allocs) {
  for (size_t i = 0; i < allocs.size(); ++i) {
    auto run = co_await img_.writer->reserve(allocs[i].first_unit, allocs[i].units);
    if (!run) {
      while (i-- > 0) img_.writer->unreserve(allocs[i].run);
      co_return run.status().with_context(img_.path);
    }
    allocs[i].run = *run;
  }
  co_return Status::ok();
}

// The old bytes of an allocation's units around the request, read through this
// driver (backing image, zeros, a compressed unit). Nothing is read or kept
// when they are zeros. Past the end of the disk they are zeros.
Task<Status> ExtentDriver::fill_cow(Allocation& a) {
  const uint64_t us = img_.writer->unit_size();
  const uint64_t unit_start = a.first_unit * us;
  const uint64_t unit_end = (a.first_unit + a.units) * us;
  const uint64_t req_end = a.guest + a.src.size();
  a.head_len = a.guest - unit_start;
  a.tail_len = unit_end - req_end;
  if (a.old_zero) co_return Status::ok();
  a.head = io::AlignedBuffer(static_cast<size_t>(a.head_len), mem_align(), true);
  a.tail = io::AlignedBuffer(static_cast<size_t>(a.tail_len), mem_align(), true);
  if (a.head_len > 0) QCOWFS_CO_TRY(co_await read(unit_start, a.head.span()));
  const uint64_t disk = size();
  const uint64_t tail_in_disk = std::min(unit_end, disk) - std::min(req_end, disk);
  if (tail_in_disk > 0) QCOWFS_CO_TRY(co_await read(req_end, a.tail.span().first(tail_in_disk)));
  co_return Status::ok();
}

// One host write: the request alone into fresh zero space whose old contents
// were zeros, else head + request + tail over the whole units (zeros made here
// when the space is not fresh: rare, space a crash left behind). Units with a
// prefix: write_prefixed().
Task<Status> ExtentDriver::write_allocation(Allocation& a) {
  const HostRun& r = a.run;
  if (!img_.writer->unit_prefix().empty()) co_return co_await write_prefixed(a);
  if (a.old_zero && r.fresh) co_return co_await r.file->write(r.host + a.head_len, a.src);
  if (a.old_zero) {
    a.head = io::AlignedBuffer(static_cast<size_t>(a.head_len), mem_align(), true);
    a.tail = io::AlignedBuffer(static_cast<size_t>(a.tail_len), mem_align(), true);
  }
  std::vector<iovec> iov;
  if (a.head_len > 0) iov.push_back(iov_of(a.head.span()));
  iov.push_back(iov_of(a.src));
  if (a.tail_len > 0) iov.push_back(iov_of(a.tail.span()));
  co_return co_await r.file->writev(r.host, iov);
}

// One host write of units that each begin with the writer's prefix: prefix,
// then the unit's part of head + request + tail, unit after unit. Into fresh
// space whose old contents are zeros, the head and tail are left out (they
// read as zeros already): the first unit's prefix then goes out on its own
// when a head lies between it and the request, beside the one write of the
// rest (another request may write into the head meanwhile: can_ride()). The
// first unit's prefix_hole is never written.
Task<Status> ExtentDriver::write_prefixed(Allocation& a) {
  const HostRun& r = a.run;
  const std::span<const std::byte> prefix = img_.writer->unit_prefix();
  const std::span<const std::byte> first_prefix = prefix.subspan(static_cast<size_t>(r.prefix_hole));
  const uint64_t us = img_.writer->unit_size();
  const bool around_reads_zero = a.old_zero && r.fresh;
  if (a.old_zero && !around_reads_zero) {
    a.head = io::AlignedBuffer(static_cast<size_t>(a.head_len), mem_align(), true);
    a.tail = io::AlignedBuffer(static_cast<size_t>(a.tail_len), mem_align(), true);
  }
  std::array<std::span<const std::byte>, 3> pieces = {a.head.span().first(static_cast<size_t>(a.head_len)), a.src,
                                                      a.tail.span()};
  uint64_t at = 0;  // guest bytes from the start of the first unit
  if (around_reads_zero) {
    pieces[0] = {};
    pieces[2] = {};
    at = a.head_len;
  }
  const uint64_t first_at = at;
  std::vector<iovec> iov;
  iov.reserve(2 * a.units + 2);
  for (std::span<const std::byte> piece : pieces) {
    while (!piece.empty()) {
      if (at % us == 0) iov.push_back(iov_of(at == 0 ? first_prefix : prefix));
      const auto n = static_cast<size_t>(std::min<uint64_t>(piece.size(), us - at % us));
      iov.push_back(iov_of(piece.first(n)));
      piece = piece.subspan(n);
      at += n;
    }
  }
  if (first_at == 0) co_return co_await r.file->writev(r.host + r.prefix_hole, iov);
  std::vector<Task<Status>> writes;
  writes.push_back(r.file->write(r.host + r.prefix_hole, first_prefix));
  writes.push_back(r.file->writev(r.host + prefix.size() + first_at, iov));
  co_return co_await io::when_all(std::move(writes));
}

}  // namespace qcowfs::image
