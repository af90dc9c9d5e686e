#include "image/extent/reader.h"

#include <algorithm>
#include <cstring>

#include "image/backing.h"
#include "image/extent/host_holes.h"
#include "io/buffer.h"
#include "io/engine.h"
#include "io/log.h"
#include "io/when_all.h"

namespace qcowfs::image {
namespace {

// Upper bound on extents one block_status() call merges, so a query over a
// huge fragmented range stays short; callers continue from the returned length.
constexpr size_t kMaxStatusExtents = 65536;

// Whether qemu-img map shows a host offset for e (data, and qcow2's
// ZERO_ALLOC and UNALLOCATED_ALLOC; never compressed).
bool shows_offset(const Extent& e) {
  return e.kind != ExtentKind::compressed && e.file != nullptr && e.show_offset;
}

// Extents qemu-img map would print as one range: same kind, and where a host
// offset is shown, the same file with host offsets that continue each other.
bool continues(const Extent& first, uint64_t length, const Extent& e) {
  if (e.kind != first.kind) return false;
  if (e.kind == ExtentKind::compressed) return true;
  if (e.kind == ExtentKind::data) {
    if (e.show_offset != first.show_offset || e.host_holes_are_zero != first.host_holes_are_zero) return false;
    return e.file == first.file && (!first.show_offset || first.host_offset + length == e.host_offset);
  }
  const bool shown = shows_offset(first);
  if (shows_offset(e) != shown) return false;
  return !shown || (e.file == first.file && first.host_offset + length == e.host_offset);
}

}  // namespace

// One host, backing or compressed read of a request.
struct ExtentReader::SubRead {
  Extent extent;
  uint64_t guest = 0;
  std::span<std::byte> dst;
};

Status ExtentReader::check(const Extent& e, uint64_t guest, uint64_t len) const {
  if (e.length == 0 || e.length > len)
    return Status::errorf(EIO, "{}: bad extent length {} at guest offset {:#x}", path_, e.length, guest);
  return Status::ok();
}

Task<Result<Extent>> ExtentReader::extent_at(uint64_t guest, uint64_t len) {
  auto found = map_.try_map(guest, len);
  if (!found) co_return found.status();
  if (!*found) co_return co_await load(guest, len);
  QCOWFS_CO_TRY(check(**found, guest, len));
  co_return **found;
}

// The extent at guest from ExtentMap::map(), which loads the metadata.
Task<Result<Extent>> ExtentReader::load(uint64_t guest, uint64_t len) {
  auto loaded = co_await map_.map(guest, len);
  if (!loaded) co_return loaded.status();
  QCOWFS_CO_TRY(check(*loaded, guest, len));
  co_return loaded;
}

// Plans the sub-reads extent by extent (try_map() inline: no coroutine frame
// per extent while the metadata is cached), then issues them together.
Task<Status> ExtentReader::read(uint64_t off, std::span<std::byte> buf) {
  const uint64_t end = off + buf.size();
  SubReads reads;
  for (uint64_t guest = off; guest < end;) {
    auto found = map_.try_map(guest, end - guest);
    if (!found) co_return found.status();
    Extent e;
    if (*found) {
      e = **found;
    } else {  // not a ternary: GCC mishandles co_await inside one
      auto loaded = co_await map_.map(guest, end - guest);
      if (!loaded) co_return loaded.status();
      e = *loaded;
    }
    QCOWFS_CO_TRY(check(e, guest, end - guest));
    add(e, guest, buf.subspan(guest - off, e.length), reads);
    guest += e.length;
  }
  if (reads.empty()) co_return Status::ok();
  if (reads.size() == 1) co_return co_await run(reads[0]);
  std::vector<Task<Status>> tasks;
  tasks.reserve(reads.size());
  for (const SubRead& r : reads) tasks.push_back(run(r));
  co_return co_await io::when_all(std::move(tasks));
}

std::optional<MappedRead> ExtentReader::map_read(uint64_t off, uint64_t len) {
  if (filter_ != nullptr) return std::nullopt;
  const uint64_t end = off + len;
  io::HostFile* file = nullptr;
  uint64_t start = 0;
  for (uint64_t guest = off; guest < end;) {
    auto found = map_.try_map(guest, end - guest);
    if (!found || !*found) return std::nullopt;  // errors and misses: read() reports or loads
    const Extent& e = **found;
    if (e.kind != ExtentKind::data || !check(e, guest, end - guest)) return std::nullopt;  // read() reports it
    if (guest == off) {
      file = e.file;
      start = e.host_offset;
    } else if (e.file != file || e.host_offset != start + (guest - off)) {
      return std::nullopt;
    }
    guest += e.length;
  }
  return MappedRead(file, start);
}

// Extent e at guest, read into dst: zeros filled at once, the rest added to
// out, coalesced with the last sub-read where it continues it (backing reads
// guest-contiguous, host reads also host-contiguous in one file).
void ExtentReader::add(const Extent& e, uint64_t guest, std::span<std::byte> dst, SubReads& out) const {
  SubRead* last = out.empty() ? nullptr : &out.back();
  const bool follows = last && last->guest + last->dst.size() == guest && last->extent.kind == e.kind;
  auto grow_last = [&] { last->dst = std::span<std::byte>(last->dst.data(), last->dst.size() + dst.size()); };
  const BlockDriver* backing = backing_.get();
  switch (e.kind) {
    case ExtentKind::zero:
      std::memset(dst.data(), 0, dst.size());
      return;
    case ExtentKind::unallocated:
      if (backing == nullptr || guest >= backing->size()) {
        std::memset(dst.data(), 0, dst.size());
      } else if (follows) {
        grow_last();
      } else {
        out.push_back(SubRead{e, guest, dst});
      }
      return;
    case ExtentKind::data:
      if (follows && last->extent.file == e.file && last->extent.host_offset + last->dst.size() == e.host_offset) {
        grow_last();
      } else {
        out.push_back(SubRead{e, guest, dst});
      }
      return;
    case ExtentKind::compressed:
      out.push_back(SubRead{e, guest, dst});
      return;
  }
}

Task<Status> ExtentReader::run(SubRead r) {
  switch (r.extent.kind) {
    case ExtentKind::data: {
      auto n = co_await r.extent.file->read(r.extent.host_offset, r.dst);
      if (!n) co_return n.status();
      if (*n < r.dst.size()) std::memset(r.dst.data() + *n, 0, r.dst.size() - *n);
      if (filter_ != nullptr) co_return co_await filter_->after_read(r.guest, r.dst);
      co_return Status::ok();
    }
    case ExtentKind::unallocated:
      co_return co_await read_backing_range(*backing_, r.guest, r.dst);
    case ExtentKind::compressed:
      co_return co_await read_compressed(r.extent, r.dst);
    case ExtentKind::zero:
      break;
  }
  std::memset(r.dst.data(), 0, r.dst.size());
  co_return Status::ok();
}

Task<Status> ExtentReader::read_compressed(const Extent& e, std::span<std::byte> dst) {
  if (e.unit_offset > e.unit_size || dst.size() > e.unit_size - e.unit_offset)
    co_return Status::errorf(EIO, "{}: compressed extent at {:#x} reaches past its unit", path_, e.host_offset);
  auto unit = co_await load_unit(e);
  if (!unit) co_return unit.status();
  std::memcpy(dst.data(), (*unit)->data() + e.unit_offset, dst.size());
  co_return Status::ok();
}

// Reads the compressed stream and decompresses it on a worker thread.
Task<Result<ClusterCache::Cluster>> ExtentReader::load_unit(const Extent& e) {
  if (auto hit = units_.find(e.host_offset)) co_return hit;
  io::AlignedBuffer in(static_cast<size_t>(e.stored_size), e.file->mem_align(), false);
  auto n = co_await e.file->read(e.host_offset, in.span());
  if (!n) co_return n.status();
  // The stream's last sector may reach past the end of the file.
  if (*n < in.size()) std::memset(in.data() + *n, 0, in.size() - *n);
  auto out = std::make_shared<io::AlignedBuffer>(static_cast<size_t>(e.unit_size), io::kMinMemAlign, false);
  Status result;
  const ExtentMap& map = map_;
  int64_t r = co_await io::offload([&]() -> int64_t {
    result = map.decompress(e, in.span(), out->span());
    return result.is_ok() ? 0 : -EIO;
  });
  if (!result) {
    log::error("{}: corrupt compressed data at host offset {:#x}: {}", path_, e.host_offset, result.message());
    co_return Status::errorf(EIO, "corrupt compressed data at host offset {:#x}: {}", e.host_offset, result.message());
  }
  if (r < 0) co_return Status::from_errno(static_cast<int>(r), "decompressing");
  ClusterCache::Cluster unit = std::move(out);
  units_.insert(e.host_offset, unit);
  co_return unit;
}

Task<Result<BlockStatus>> ExtentReader::block_status(uint64_t off, uint64_t len) {
  Extent first;
  uint64_t length = 0;
  for (size_t n = 0; length < len && n < kMaxStatusExtents; ++n) {
    auto e = co_await extent_at(off + length, len - length);
    if (!e) co_return e.status();
    if (n == 0) {
      first = *e;
    } else if (!continues(first, length, *e)) {
      break;
    }
    length += e->length;
  }
  const BlockDriver* backing = backing_.get();
  if (first.kind == ExtentKind::unallocated && backing != nullptr && off < backing->size())
    co_return co_await backing_status(off, length);
  BlockStatus b;
  b.length = length;
  // Unallocated with nothing below: zeros that no layer records.
  b.present = first.kind != ExtentKind::unallocated;
  b.data = first.kind == ExtentKind::data || first.kind == ExtentKind::compressed;
  b.zero = first.kind == ExtentKind::zero || first.kind == ExtentKind::unallocated;
  if (shows_offset(first)) {
    b.file = first.file;
    b.host_offset = first.host_offset;
    if (first.kind == ExtentKind::data && first.host_holes_are_zero)
      QCOWFS_CO_TRY(co_await apply_host_holes(*first.file, b));
  }
  co_return b;
}

Task<Result<BlockStatus>> ExtentReader::backing_status(uint64_t guest, uint64_t len) {
  BlockDriver& backing = *backing_;
  auto r = co_await backing.block_status(guest, std::min(len, backing.size() - guest));
  if (!r) co_return r.status();
  r->depth += 1;
  co_return r;
}

}  // namespace qcowfs::image
