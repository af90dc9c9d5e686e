// qcowfs check: consistency check and repair of an image through its
// format's check (image/check.h), with the output and exit codes of
// `qemu-img check` (0 clean, 1 check not completed, 2 corruptions, 3 leaks
// only, 63 format without checks or without repair).
#include <unistd.h>

#include <cstdio>
#include <cstring>

#include "image/check.h"
#include "image/format.h"
#include "tools/cmd.h"
#include "image/json.h"

namespace qcowfs::tools {
namespace {



constexpr int kExitNoChecks = 63;
// L2 metadata to walk before a progress bar is worth showing on a terminal.
constexpr uint64_t kProgressMinMetadata = 2ull << 30;

struct CheckArgs : ImageCommandArgs {
  image::RepairMode repair = image::RepairMode::none;
  bool quiet = false;
};

Result<image::RepairMode> parse_repair(const std::string& v) {
  if (v == "leaks") return image::RepairMode::leaks;
  if (v == "all") return image::RepairMode::all;
  return Status::errorf(EINVAL, "bad repair mode '{}' (expected leaks or all)", v);
}

Result<CheckArgs> parse_check_args(std::span<const std::string> args) {
  CheckArgs a;
  QCOWFS_TRY(parse_image_command(args, a, [&](std::span<const std::string> as, size_t& i) -> Result<bool> {
    std::string v;
    if (as[i] == "-q" || as[i] == "--quiet") {
      a.quiet = true;
      return true;
    }
    if (!take_option(as, i, "--repair", "-r", v)) return false;
    auto r = parse_repair(v);
    if (!r) return r.status();
    a.repair = *r;
    return true;
  }));
  if (a.force_share && a.repair != image::RepairMode::none)
    return Status::error(EINVAL, "-U (--force-share) reads only: it cannot be used with -r");
  return a;
}

Json report_json(const image::CheckReport& r, const std::string& filename, const std::string& format) {
  Json j = Json::object();
  auto optional = [&](const char* key, uint64_t v) {
    if (v != 0) j.set(key, v);
  };
  optional("image-end-offset", r.image_end_offset);
  optional("total-clusters", r.total_clusters);
  j.set("check-errors", r.check_errors);
  optional("allocated-clusters", r.allocated_clusters);
  optional("fragmented-clusters", r.fragmented_clusters);
  optional("compressed-clusters", r.compressed_clusters);
  optional("corruptions", r.corruptions);
  optional("leaks", r.leaks);
  optional("corruptions-fixed", r.corruptions_fixed);
  optional("leaks-fixed", r.leaks_fixed);
  j.set("filename", filename);
  j.set("format", format);
  return j;
}

void print_human(const image::CheckReport& r) {
  if (r.corruptions_fixed || r.leaks_fixed)
    fmt::print("The following inconsistencies were found and repaired:\n\n    {} leaked clusters\n    {} corruptions\n\n"
               "Double checking the fixed image now...\n", r.leaks_fixed, r.corruptions_fixed);
  if (!(r.corruptions || r.leaks || r.check_errors)) {
    fmt::print("No errors were found on the image.\n");
  } else {
    if (r.corruptions)
      fmt::print("\n{} errors were found on the image.\nData may be corrupted, or further writes to the image may "
                 "corrupt it.\n", r.corruptions);
    if (r.leaks)
      fmt::print("\n{} leaked clusters were found on the image.\nThis means waste of disk space, but no harm to data.\n",
                 r.leaks);
    if (r.check_errors) fmt::print("\n{} internal errors have occurred during the check.\n", r.check_errors);
  }
  if (r.total_clusters && r.allocated_clusters) {
    auto pct = [](uint64_t a, uint64_t b) { return static_cast<double>(a) * 100.0 / static_cast<double>(b); };
    fmt::print("{}/{} = {:.2f}% allocated, {:.2f}% fragmented, {:.2f}% compressed clusters\n", r.allocated_clusters,
               r.total_clusters, pct(r.allocated_clusters, r.total_clusters),
               pct(r.fragmented_clusters, r.allocated_clusters), pct(r.compressed_clusters, r.allocated_clusters));
  }
  if (r.image_end_offset) fmt::print("Image end offset: {}\n", r.image_end_offset);
}

int exit_code(const image::CheckReport& r) {
  if (r.check_errors) return 1;
  if (r.corruptions) return 2;
  if (r.leaks) return 3;
  return 0;
}

// A one-line bar on stderr, redrawn in place when the percentage changes;
// only used on a terminal and only when there is a lot of metadata to walk.
class ProgressBar {
 public:
  void operator()(uint64_t done, uint64_t total) {
    if (total < kProgressMinMetadata) return;
    int pct = static_cast<int>(done * 100 / total);
    if (pct == last_) return;
    last_ = pct;
    std::string bar(static_cast<size_t>(pct / 2), '#');
    fmt::print(stderr, "\r    ({:3d}/100%) [{:<50}]", pct, bar);
    if (done == total) fmt::print(stderr, "\n");
  }

 private:
  int last_ = -1;
};

// The check of the image's format; *format_name is the format's name once known.
Task<Result<image::CheckReport>> run_check(const CheckArgs& a, bool* no_checks, std::string* format_name) {
  io::OpenOptions o = a.read_options();
  o.writable = a.repair != image::RepairMode::none;
  auto image = co_await open_image_file(a.image, o, a.format, "");
  if (!image) co_return image.status();
  io::HostFile& file = *image->file;
  *format_name = image->format;
  const image::FormatInfo* format = image::find_format(image->format);
  if (!format || !format->check) {
    *no_checks = true;
    co_return image::check_not_supported();
  }
  image::CheckOptions opts;
  opts.repair = a.repair;
  if (!a.json && !a.quiet && ::isatty(STDERR_FILENO)) opts.progress = ProgressBar();
  auto r = co_await format->check(file, a.image, opts);
  if (!r) *no_checks = image::is_check_not_supported(r.status());
  if (r && file.writable()) QCOWFS_CO_TRY(co_await file.flush());
  co_return r;
}

}  // namespace

std::string_view check_usage() {
  return "usage: qcowfs check [-r leaks|all | -U] [--json] [-f FORMAT] [-q] IMAGE\n"
         "\n"
         "Checks an image for consistency, like qemu-img check. qcow2: leaked clusters,\n"
         "refcount mismatches, overlapping metadata, entries outside the file, invalid\n"
         "subcluster bitmaps and wrong copied flags, in the active tables and in every\n"
         "snapshot; QED: invalid or shared L1/L2 entries and leaked clusters; Parallels:\n"
         "the in-use flag, BAT entries past the end and leaked space at the end; VDI:\n"
         "block map entries out of range or shared, blocks_allocated; VMDK: grains past\n"
         "the end of their extent file; VHDX: BAT entries past the end or over the log\n"
         "or a region, a log to replay (replayed with -r). Exit status: 0 clean, 1 check\n"
         "not completed, 2 corruptions, 3 leaked clusters only, 63 the format has no\n"
         "checks (raw, vpc) or no repair (vdi, vmdk with -r).\n"
         "\n"
         "  -r, --repair=leaks   repair leaks (qcow2: lower their refcounts; Parallels:\n"
         "                       truncate; QED: clear invalid entries, need-check)\n"
         "  -r, --repair=all     also repair corruptions (qcow2: copied flags, refcounts;\n"
         "                       Parallels: the in-use flag, entries past the end)\n"
         "  --json               print the result as JSON (--output=json)\n"
         "  -f, --format=FMT     image format (default: probed)\n"
         "  -U, --force-share    check an image another process (a VM, a rw mount) is writing\n"
         "                       (its locks are shared; a check of a changing image may report\n"
         "                       errors that are not there; not with -r)\n"
         "  -q, --quiet          print nothing but errors\n"
         "  -h, --help           show this text\n";
}

int cmd_check(std::span<const std::string> args) {
  return run_tool("check", check_usage(), parse_check_args(args), [](const CheckArgs& a, io::Engine& engine) {
    bool no_checks = false;
    std::string format;
    auto r = io::run_sync(engine, run_check(a, &no_checks, &format));
    if (!r) return cmd_fail("check", r.status(), no_checks ? kExitNoChecks : 1);
    if (!a.quiet || r->failed_errno)
      for (const auto& m : r->messages) fmt::print(stderr, "{}\n", m);
    if (r->failed_errno)
      return cmd_fail("check", Status::errorf(r->failed_errno, "Check failed: {}", std::strerror(r->failed_errno)), 1);
    if (a.json) fmt::print("{}\n", report_json(*r, a.image, format).render());
    else if (!a.quiet) print_human(*r);
    return exit_code(*r);
  });
}

}  // namespace qcowfs::tools
