#include "image/extent/driver.h"

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

// Extents qemu-img map would print as one range: same kind, and for data the
// same file with host offsets that continue each other.
bool continues(const Extent& first, uint64_t length, const Extent& e) {
  if (e.kind != first.kind) return false;
  if (e.kind != ExtentKind::data) return true;
  if (e.show_offset != first.show_offset || e.host_holes_are_zero != first.host_holes_are_zero) return false;
  return e.file == first.file && (!first.show_offset || first.host_offset + length == e.host_offset);
}

size_t cluster_cache_capacity(uint64_t unit_size) {
  return unit_size == 0 ? 1 : ClusterCache::default_capacity(unit_size);
}

}  // namespace

Task<Result<Extent>> ExtentMap::map(uint64_t guest, uint64_t len) {
  auto e = try_map(guest, len);
  if (!e) co_return e.status();
  if (!*e) co_return Status::errorf(EIO, "no mapping for guest offset {:#x}", guest);
  co_return **e;
}

Status ExtentMap::decompress(const Extent&, std::span<const std::byte>, std::span<std::byte>) const {
  return Status::error(EIO, "the format has no compressed extents");
}

// One host, backing or compressed read of a request.
struct ExtentDriver::SubRead {
  Extent extent;
  uint64_t guest = 0;
  std::span<std::byte> dst;
};

ExtentDriver::ExtentDriver(ExtentImage image)
    : img_(std::move(image)),
      units_(cluster_cache_capacity(img_.compressed_unit_size)),
      size_(img_.size),
      unmaps_(img_.writer != nullptr && img_.writer->can_unmap()) {}

ExtentDriver::~ExtentDriver() = default;

size_t ExtentDriver::mem_align() const {
  size_t a = io::kMinMemAlign;
  for (const auto& f : img_.files) a = std::max(a, f->mem_align());
  return a;
}

// A Ticket for a lock-free I/O when the writer unmaps (image/extent/in_flight.h).
InFlightIo::Ticket ExtentDriver::track() { return unmaps_ ? in_flight_.enter() : InFlightIo::Ticket(); }

// The map's extent at guest, checked: between 1 and len bytes long.
Task<Result<Extent>> ExtentDriver::extent_at(uint64_t guest, uint64_t len) {
  auto found = img_.map->try_map(guest, len);
  if (!found) co_return found.status();
  Extent e;
  if (*found) {
    e = **found;
  } else {
    auto loaded = co_await img_.map->map(guest, len);
    if (!loaded) co_return loaded.status();
    e = *loaded;
  }
  if (e.length == 0 || e.length > len)
    co_return Status::errorf(EIO, "{}: bad extent length {} at guest offset {:#x}", img_.path, e.length, guest);
  co_return e;
}

Task<Status> ExtentDriver::read(uint64_t off, std::span<std::byte> buf) {
  if (buf.empty()) co_return Status::ok();
  InFlightIo::Ticket ticket = track();  // until the host reads completed
  std::vector<SubRead> reads;
  QCOWFS_CO_TRY(co_await plan(off, buf, reads));
  if (reads.size() == 1) co_return co_await run(reads.front());
  std::vector<Task<Status>> tasks;
  tasks.reserve(reads.size());
  for (const SubRead& r : reads) tasks.push_back(run(r));
  co_return co_await io::when_all(std::move(tasks));
}

// The host, backing and compressed reads of [start, start + buf.size()),
// coalesced; zero extents are filled in buf at once.
Task<Status> ExtentDriver::plan(uint64_t start, std::span<std::byte> buf, std::vector<SubRead>& out) {
  const uint64_t end = start + buf.size();
  BlockDriver* backing = img_.backing.get();
  uint64_t guest = start;
  while (guest < end) {
    auto e = co_await extent_at(guest, end - guest);
    if (!e) co_return e.status();
    std::span<std::byte> dst = buf.subspan(guest - start, e->length);
    SubRead* last = out.empty() ? nullptr : &out.back();
    const bool follows = last && last->guest + last->dst.size() == guest && last->extent.kind == e->kind;
    auto grow_last = [&] { last->dst = std::span<std::byte>(last->dst.data(), last->dst.size() + dst.size()); };
    switch (e->kind) {
      case ExtentKind::zero:
        std::memset(dst.data(), 0, dst.size());
        break;
      case ExtentKind::unallocated:
        if (backing == nullptr || guest >= backing->size()) {
          std::memset(dst.data(), 0, dst.size());
        } else if (follows) {
          grow_last();
        } else {
          out.push_back(SubRead{*e, guest, dst});
        }
        break;
      case ExtentKind::data:
        if (follows && last->extent.file == e->file && last->extent.host_offset + last->dst.size() == e->host_offset) {
          grow_last();
        } else {
          out.push_back(SubRead{*e, guest, dst});
        }
        break;
      case ExtentKind::compressed:
        out.push_back(SubRead{*e, guest, dst});
        break;
    }
    guest += e->length;
  }
  co_return Status::ok();
}

Task<Status> ExtentDriver::run(SubRead r) {
  switch (r.extent.kind) {
    case ExtentKind::data: {
      auto n = co_await r.extent.file->read(r.extent.host_offset, r.dst);
      if (!n) co_return n.status();
      if (*n < r.dst.size()) std::memset(r.dst.data() + *n, 0, r.dst.size() - *n);
      co_return Status::ok();
    }
    case ExtentKind::unallocated:
      co_return co_await read_backing(r.guest, r.dst);
    case ExtentKind::compressed:
      co_return co_await read_compressed(r.extent, r.dst);
    case ExtentKind::zero:
      break;
  }
  std::memset(r.dst.data(), 0, r.dst.size());
  co_return Status::ok();
}

Task<Status> ExtentDriver::read_backing(uint64_t guest, std::span<std::byte> dst) {
  return read_backing_range(*img_.backing, guest, dst);
}

Task<Status> ExtentDriver::read_compressed(const Extent& e, std::span<std::byte> dst) {
  if (e.unit_offset > e.unit_size || dst.size() > e.unit_size - e.unit_offset)
    co_return Status::errorf(EIO, "{}: compressed extent at {:#x} reaches past its unit", img_.path, e.host_offset);
  auto unit = co_await load_unit(e);
  if (!unit) co_return unit.status();
  std::memcpy(dst.data(), (*unit)->data() + e.unit_offset, dst.size());
  co_return Status::ok();
}

// Reads the compressed stream and decompresses it on a worker thread.
Task<Result<ClusterCache::Cluster>> ExtentDriver::load_unit(const Extent& e) {
  if (auto hit = units_.find(e.host_offset)) co_return hit;
  io::AlignedBuffer in(static_cast<size_t>(e.stored_size), e.file->mem_align(), false);
  auto n = co_await e.file->read(e.host_offset, in.span());
  if (!n) co_return n.status();
  if (*n < in.size()) std::memset(in.data() + *n, 0, in.size() - *n);
  auto out = std::make_shared<io::AlignedBuffer>(static_cast<size_t>(e.unit_size), io::kMinMemAlign, false);
  Status result;
  const ExtentMap& map = *img_.map;
  int64_t r = co_await io::offload([&]() -> int64_t {
    result = map.decompress(e, in.span(), out->span());
    return result.is_ok() ? 0 : -EIO;
  });
  if (!result) {
    log::error("{}: corrupt compressed data at host offset {:#x}: {}", img_.path, e.host_offset, result.message());
    co_return Status::errorf(EIO, "corrupt compressed data at host offset {:#x}: {}", e.host_offset, result.message());
  }
  if (r < 0) co_return Status::from_errno(static_cast<int>(r), "decompressing");
  ClusterCache::Cluster unit = std::move(out);
  units_.insert(e.host_offset, unit);
  co_return unit;
}

Task<Result<BlockStatus>> ExtentDriver::block_status(uint64_t off, uint64_t len) {
  const uint64_t disk = size();
  len = std::min(len, disk - std::min(off, disk));
  if (len == 0) co_return Status::errorf(EINVAL, "block status query at {:#x} is beyond the end of the image", off);
  if (!img_.reports_status) {
    BlockStatus b;
    b.length = len;
    b.data = true;
    b.present = true;
    co_return b;
  }
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
  BlockDriver* backing = img_.backing.get();
  if (first.kind == ExtentKind::unallocated && backing != nullptr && off < backing->size())
    co_return co_await backing_status(off, length);
  BlockStatus b;
  b.length = length;
  b.present = first.kind != ExtentKind::unallocated;
  b.data = first.kind == ExtentKind::data || first.kind == ExtentKind::compressed;
  b.zero = first.kind == ExtentKind::zero || first.kind == ExtentKind::unallocated;
  if (first.kind == ExtentKind::data && first.show_offset) {
    b.file = first.file;
    b.host_offset = first.host_offset;
    if (first.host_holes_are_zero) QCOWFS_CO_TRY(co_await apply_host_holes(*first.file, b));
  }
  co_return b;
}

Task<Result<BlockStatus>> ExtentDriver::backing_status(uint64_t guest, uint64_t len) {
  BlockDriver& backing = *img_.backing;
  auto r = co_await backing.block_status(guest, std::min(len, backing.size() - guest));
  if (!r) co_return r.status();
  r->depth += 1;
  co_return r;
}

Status ExtentDriver::refuse_write() const {
  return Status::errorf(EROFS, "the {} image is open read-only", img_.format);
}

uint64_t ExtentDriver::allocated_bytes() const {
  uint64_t n = 0;
  for (const auto& f : img_.files) n += f->allocated_bytes();
  return n;
}

}  // namespace qcowfs::image
