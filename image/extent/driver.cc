#include "image/extent/driver.h"

#include <algorithm>

#include "io/buffer.h"

namespace qcowfs::image {
namespace {

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

ExtentDriver::ExtentDriver(ExtentImage image)
    : img_(std::move(image)),
      units_(cluster_cache_capacity(img_.compressed_unit_size)),
      reader_(img_.path, *img_.map, img_.backing, units_),
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

// Reads take no lock; where the writer unmaps, they count themselves until
// their host reads completed (image/extent/in_flight.h).
Task<Status> ExtentDriver::read(uint64_t off, std::span<std::byte> buf) {
  if (!unmaps_) return reader_.read(off, buf);
  return read_tracked(off, buf);
}

// As read(): the ticket from before the lookup until the host read is done.
std::optional<MappedRead> ExtentDriver::map_read(uint64_t off, uint64_t len) {
  if (!unmaps_) return reader_.map_read(off, len);
  InFlightIo::Ticket ticket = in_flight_.enter();
  std::optional<MappedRead> run = reader_.map_read(off, len);
  if (run) run->keep(std::move(ticket).into_hold());
  return run;
}

Task<Status> ExtentDriver::read_tracked(uint64_t off, std::span<std::byte> buf) {
  InFlightIo::Ticket ticket = in_flight_.enter();
  co_return co_await reader_.read(off, buf);
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
  co_return co_await reader_.block_status(off, len);
}

Status ExtentDriver::refuse_write() const {
  return Status::errorf(EROFS, "the {} image is open read-only", img_.format);
}

uint64_t ExtentDriver::allocated_bytes() const {
  uint64_t n = 0;
  for (const auto& f : img_.files) n += f->allocated_bytes();
  return n;
}

Status take_writer(ExtentImage& img, Result<std::unique_ptr<ExtentWriter>> writer) {
  if (!writer) return writer.status();
  img.writer = std::move(*writer);
  return Status::ok();
}

std::unique_ptr<BlockDriver> one_file_driver(ExtentImage img, std::unique_ptr<ExtentMap> map,
                                             std::unique_ptr<io::HostFile> file) {
  img.map = std::move(map);
  img.files.push_back(std::move(file));
  return std::make_unique<ExtentDriver>(std::move(img));
}

}  // namespace qcowfs::image
