// check_vhdx(): QEMU 7.2's vhdx_co_check() with vhdx_check_bat_entries()
// counting its findings (errcnt) instead of refusing at the first.
#include "image/vhdx/vhdx_check.h"

#include <algorithm>
#include <limits>

#include "image/vhdx/bat.h"
#include "image/vhdx/format.h"

namespace qcowfs::image {
namespace {

using vhdx::Layout;

// The range QEMU's vhdx_region_check() names for [start, start + length): the
// first in its list (the last registered) that overlaps; nullptr for none.
const vhdx::FileRange* overlapping(const vhdx::Regions& r, uint64_t start, uint64_t length) {
  const uint64_t end = start + length;
  auto it = std::find_if(r.used.rbegin(), r.used.rend(),
                         [&](const vhdx::FileRange& u) { return !(start >= u.end || end <= u.start); });
  return it == r.used.rend() ? nullptr : &*it;
}

// One FULLY_PRESENT entry, as vhdx_check_bat_entries() with an error count.
void check_entry(const Layout& l, uint64_t file_size, uint64_t i, uint64_t entry, bool payload, CheckReport& r) {
  const vhdx::Geometry& g = l.geometry;
  const uint64_t off = entry & vhdx::kBatOffsetMask;
  // QEMU's unsigned arithmetic: past the disk the difference wraps, a whole block.
  const uint64_t block_length = std::min<uint64_t>(g.block_size, g.size - i * g.block_size);
  const auto error = [&](std::string message) {
    r.messages.push_back(std::move(message));
    ++r.corruptions;
  };
  if (off > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) - g.block_size)
    error(fmt::format("VHDX BAT entry {} offset overflow.", i));
  if (off >= file_size)
    error(fmt::format("VHDX BAT entry {} start offset {} points after end of file ({}). Image has probably been "
                      "truncated.",
                      i, off, file_size));
  else if (off + block_length > file_size)
    error(fmt::format("VHDX BAT entry {} end offset {} points after end of file ({}). Image has probably been "
                      "truncated.",
                      i, off + block_length - 1, file_size));
  if (!payload) return;
  if (const vhdx::FileRange* u = overlapping(l.regions, off, g.block_size))
    error(fmt::format("VHDX region {}-{} overlaps with region {}-{}", off, off + g.block_size, u->start, u->end));
}

}  // namespace

Task<Result<CheckReport>> check_vhdx(io::HostFile& file, std::string path, CheckOptions opts) {
  const bool repair = opts.repair != RepairMode::none;
  if (repair && !file.writable()) co_return Status::error(EROFS, "repairing needs the image opened read-write");
  auto layout = co_await vhdx::open_for_check(file, path, repair);
  if (!layout) co_return layout.status();
  CheckReport r;
  if (layout->replayed) r.corruptions_fixed = 1;  // QEMU: log_replayed_on_open
  const uint64_t file_size = file.size();
  const uint64_t total = uint64_t{layout->geometry.bat_entries};
  QCOWFS_CO_TRY(co_await vhdx::for_each_present(file, layout->geometry, layout->regions, path,
                                                [&](uint64_t i, uint64_t entry, bool payload) {
                                                  check_entry(*layout, file_size, i, entry, payload, r);
                                                  if (opts.progress && i % 65536 == 0) opts.progress(i, total);
                                                  return Status::ok();
                                                }));
  if (opts.progress) opts.progress(total, total);
  co_return r;
}

}  // namespace qcowfs::image
