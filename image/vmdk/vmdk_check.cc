// check_vmdk(): the grain walk of QEMU 7.2's vmdk_co_check().
#include "image/vmdk/vmdk_check.h"

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "image/endian.h"
#include "image/extent/host_read.h"
#include "image/vmdk/format.h"

namespace qcowfs::image {
namespace {

using vmdk::VExtent;

// Grains walked between two progress reports.
constexpr uint64_t kProgressEvery = 1 << 16;

// The walk: one step per grain (QEMU's cluster_sectors; a FLAT extent is one
// step), the grain table of the step in memory.
class GrainWalk {
 public:
  GrainWalk(const std::vector<VExtent>& extents, CheckReport& r) : extents_(extents), r_(r) {}

  // Checks the step at guest byte pos; returns the next step's position, or
  // nullopt once the walk failed (r_.failed_errno set).
  Task<std::optional<uint64_t>> step(uint64_t pos) {
    const VExtent& x = find(pos);
    const uint64_t sector = pos / vmdk::kSector;
    if (x.flat) {
      if (x.flat_offset >= x.file->size()) co_return fail(past_eof(sector), EINVAL);
      co_return pos + x.size;
    }
    const uint64_t rel = pos - x.start;
    const uint64_t index = rel / x.gd_coverage;
    if (index >= x.gd_size) co_return fail(no_offset(sector), EPERM);  // VMDK_ERROR is -1
    const uint32_t gt = index < x.gd.size() ? x.gd[index] : 0;
    if (gt == 0) {  // every step up to the end of the GD entry or extent is unallocated
      const uint64_t end = x.start + std::min((index + 1) * x.gd_coverage, x.size);
      co_return pos + (end - pos + x.grain_bytes - 1) / x.grain_bytes * x.grain_bytes;
    }
    if (!(table_file_ == x.file && table_sector_ == gt)) {
      table_.assign(size_t{x.gtes} * 4, std::byte{0});
      auto st = co_await read_padded(*x.file, uint64_t{gt} * vmdk::kSector, table_);
      if (!st) co_return fail(no_offset(sector), EPERM);
      table_file_ = x.file;
      table_sector_ = gt;
    }
    const uint32_t gte = load_le32(table_.data() + (rel / x.grain_bytes) % x.gtes * 4);
    const bool allocated = gte != 0 && !(x.zero_grain && gte == vmdk::kGteZeroed);
    if (allocated && uint64_t{gte} * vmdk::kSector >= x.file->size()) co_return fail(past_eof(sector), EINVAL);
    co_return pos + x.grain_bytes;
  }

 private:
  const VExtent& find(uint64_t pos) const {
    auto it = std::upper_bound(extents_.begin(), extents_.end(), pos,
                               [](uint64_t g, const VExtent& x) { return g < x.start; });
    return *(it - 1);
  }
  static std::string past_eof(uint64_t sector) {
    return fmt::format("ERROR: cluster offset for sector {} points after EOF", sector);
  }
  static std::string no_offset(uint64_t sector) {
    return fmt::format("ERROR: could not get cluster_offset for sector {}", sector);
  }
  std::optional<uint64_t> fail(std::string message, int err) {
    r_.messages.push_back(std::move(message));
    r_.failed_errno = err;
    ++r_.corruptions;
    return std::nullopt;
  }

  const std::vector<VExtent>& extents_;
  CheckReport& r_;
  const io::HostFile* table_file_ = nullptr;
  uint32_t table_sector_ = 0;
  std::vector<std::byte> table_;
};

}  // namespace

Task<Result<CheckReport>> check_vmdk(io::HostFile& file, std::string path, CheckOptions opts) {
  ImageOptions defaults;  // named: GCC 12 mis-destroys a prvalue class argument of a coroutine
  auto image = co_await vmdk::open_for_check(file, path, std::move(defaults));
  if (!image) co_return image.status();
  if (opts.repair != RepairMode::none) co_return check_not_supported();
  CheckReport r;
  GrainWalk walk(image->extents, r);
  uint64_t steps = 0;
  for (uint64_t pos = 0; pos < image->size;) {
    auto next = co_await walk.step(pos);
    if (!next) break;
    pos = *next;
    if (opts.progress && (++steps % kProgressEvery == 0 || pos >= image->size))
      opts.progress(std::min(pos, image->size), image->size);
  }
  co_return r;
}

}  // namespace qcowfs::image
