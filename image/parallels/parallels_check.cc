// check_parallels(): the header and the BAT read once (as QEMU's open reads
// them), one pass over the BAT (fixing when asked), qemu-img check's double
// check after a fix, then what QEMU's close of a read-write open does.
//
// Where qcowfs differs from QEMU 7.2 on purpose: QEMU's close truncates the
// file to the data end it computed at open, counting BAT entries that lie
// outside the file and the ones -r all has just cleared, so a repaired image
// can grow by up to terabytes and be left with leaks (a later QEMU fixes
// this); qcowfs computes the data end from the BAT as repaired, skips
// entries outside the file and only ever extends the file to it.
#include "image/parallels/parallels_check.h"

#include <algorithm>
#include <array>
#include <vector>

#include "image/check_open.h"
#include "image/endian.h"
#include "image/extent/host_read.h"
#include "image/parallels/format.h"
#include "image/parallels/header.h"
#include "image/parallels/parallels.h"

namespace qcowfs::image {
namespace {

using parallels::kSector;

struct Image {
  parallels::Header h;
  uint32_t inuse_field = 0;    // the header's inuse field as read
  std::vector<uint32_t> bat;  // the entries inside the file; the rest read as 0
  bool unclean = false;       // QEMU's header_unclean
  uint64_t unit() const { return h.off_multiplier * kSector; }
};

Task<Result<Image>> read_image(io::HostFile& file, const std::string& path) {
  std::array<std::byte, parallels::kHeaderSize> b;
  QCOWFS_CO_TRY(co_await read_padded(file, 0, b));
  auto h = parallels::parse_header(b, path);
  if (!h) co_return h.status();
  Image img{.h = *h, .inuse_field = load_le32(&b[parallels::kInuseOff]), .bat = {}, .unclean = h->inuse};
  const uint64_t fsize = file.size();
  const uint64_t in_file = fsize > parallels::kBatOff ? (fsize - parallels::kBatOff) / 4 : 0;
  const uint64_t n = std::min<uint64_t>(h->bat_entries, in_file);
  if (n > parallels::kMaxBatInMemory)
    co_return Status::errorf(EFBIG, "{}: Parallels BAT of {} entries is past qcowfs's limit of {}", path, n,
                             parallels::kMaxBatInMemory);
  std::vector<std::byte> raw(static_cast<size_t>(n * 4));
  QCOWFS_CO_TRY(co_await read_padded(file, parallels::kBatOff, raw));
  img.bat.resize(static_cast<size_t>(n));
  for (size_t i = 0; i < img.bat.size(); ++i) img.bat[i] = load_le32(raw.data() + i * 4);
  co_return img;
}

// The file size as QEMU's bdrv_getlength() gives it: whole sectors.
uint64_t file_length(const io::HostFile& file) { return (file.size() + kSector - 1) / kSector * kSector; }

const char* verb(bool fixing) { return fixing ? "Repairing" : "ERROR"; }

// The BAT walk of parallels_co_check(): entries past the end of the file are
// corruptions (cleared with fix_errors, each written back); the others are
// counted, the highest gives image-end-offset.
Task<Status> check_bat(io::HostFile& file, Image& img, bool fix_errors, CheckReport& r) {
  const uint64_t size = file_length(file);
  const uint64_t cs = img.h.cluster_size();
  uint64_t high = 0, prev = 0;
  for (size_t i = 0; i < img.bat.size(); ++i) {
    const uint64_t off = uint64_t{img.bat[i]} * img.unit();
    if (off == 0) {
      prev = 0;
      continue;
    }
    if (off > size) {
      r.messages.push_back(fmt::format("{} cluster {} is outside image", verb(fix_errors), i));
      ++r.corruptions;
      if (fix_errors) {
        prev = 0;
        img.bat[i] = 0;
        ++r.corruptions_fixed;
        std::array<std::byte, 4> zero{};
        QCOWFS_CO_TRY(co_await file.write(parallels::kBatOff + i * 4, zero));
        continue;
      }
    }
    ++r.allocated_clusters;
    high = std::max(high, off);
    if (prev != 0 && prev + cs != off) ++r.fragmented_clusters;
    prev = off;
  }
  if (r.corruptions_fixed > 0) QCOWFS_CO_TRY(co_await file.flush());
  r.image_end_offset = high + cs;
  co_return Status::ok();
}

// The file past image-end-offset: leaked clusters, truncated with fix_leaks.
Task<Status> check_tail(io::HostFile& file, const Image& img, bool fix_leaks, CheckReport& r) {
  const uint64_t size = file_length(file);
  if (size <= r.image_end_offset) co_return Status::ok();
  const uint64_t count = (size - r.image_end_offset + img.h.cluster_size() - 1) / img.h.cluster_size();
  r.messages.push_back(
      fmt::format("{} space leaked at the end of the image {}", verb(fix_leaks), size - r.image_end_offset));
  r.leaks += count;
  if (!fix_leaks) co_return Status::ok();
  QCOWFS_CO_TRY(co_await file.truncate(r.image_end_offset));
  r.leaks_fixed += count;
  co_return Status::ok();
}

CheckReport check_pass_failed(CheckReport r, const Status& st) {
  ++r.check_errors;
  r.messages.push_back(fmt::format("ERROR {}", st.to_string()));
  return r;
}

Task<CheckReport> check_pass(io::HostFile& file, Image& img, RepairMode repair) {
  const bool fix_errors = repair == RepairMode::all;
  CheckReport r;
  if (img.unclean) {
    r.messages.push_back(fmt::format("{} image was not closed correctly", verb(fix_errors)));
    ++r.corruptions;
    if (fix_errors) {
      ++r.corruptions_fixed;
      img.unclean = false;  // cleared on disk by close_like_qemu()
    }
  }
  r.total_clusters = img.h.bat_entries;
  Status st = co_await check_bat(file, img, fix_errors, r);
  if (st) st = co_await check_tail(file, img, repair != RepairMode::none, r);
  co_return st ? r : check_pass_failed(std::move(r), st);
}

// QEMU 7.2's data end (parallels_open), in sectors: data_off, or without one
// the end of the BAT in bytes, used as sectors as QEMU does; then past every
// cluster at or after it, in BAT order. Entries outside the file are skipped.
uint64_t data_end_sectors(const Image& img, uint64_t file_size) {
  uint64_t end = img.h.data_off;
  if (end == 0) end = (parallels::kBatOff + uint64_t{img.h.bat_entries} * 4 + kSector - 1) / kSector * kSector;
  for (uint32_t e : img.bat) {
    const uint64_t sector = uint64_t{e} * img.h.off_multiplier;
    if (sector * kSector > file_size) continue;
    if (sector >= end) end = sector + img.h.tracks;
  }
  return end;
}

// What closing QEMU's read-write open does after any -r: the in-use field is
// zeroed and the file reaches the data end.
Task<Status> close_like_qemu(io::HostFile& file, const Image& img) {
  if (img.inuse_field != 0) {
    std::array<std::byte, 4> zero{};
    QCOWFS_CO_TRY(co_await file.write(parallels::kInuseOff, zero));
  }
  const uint64_t end = data_end_sectors(img, file_length(file)) * kSector;
  if (end > file.size()) QCOWFS_CO_TRY(co_await file.truncate(end));
  co_return co_await file.flush();
}

}  // namespace

Task<Result<CheckReport>> check_parallels(io::HostFile& file, std::string path, CheckOptions opts) {
  const bool fix = opts.repair != RepairMode::none;
  if (fix && !file.writable()) co_return Status::error(EROFS, "repairing needs the image opened read-write");
  // A read-only open also checks the format extension; QEMU's read-write one
  // ignores it.
  if (!fix) QCOWFS_CO_TRY(co_await open_for_check(file, path, open_parallels));
  auto img = co_await read_image(file, path);
  if (!img) co_return img.status();
  CheckReport first = co_await check_pass(file, *img, opts.repair);
  if (opts.progress) opts.progress(1, 1);
  if (!fix) co_return first;
  CheckReport report = std::move(first);
  if (report.corruptions_fixed > 0 || report.leaks_fixed > 0) {
    // qemu-img's double check of the fixed image, reported with the fixes.
    CheckReport second = co_await check_pass(file, *img, RepairMode::none);
    second.corruptions_fixed = report.corruptions_fixed;
    second.leaks_fixed = report.leaks_fixed;
    report.messages.insert(report.messages.end(), second.messages.begin(), second.messages.end());
    second.messages = std::move(report.messages);
    report = std::move(second);
  }
  QCOWFS_CO_TRY(co_await close_like_qemu(file, *img));
  co_return report;
}

}  // namespace qcowfs::image
