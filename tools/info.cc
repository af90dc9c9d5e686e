// qcowfs info: what `qemu-img info` shows about an image (and with
// --backing-chain, about every image of its chain), as text or as JSON with
// qemu-img's --output=json field names. What is shown is what the image's
// format describes (image/describe.h, through the registry); this file only
// lays it out as qemu-img 7.2 does.
#include <algorithm>
#include <cstdio>
#include <ctime>

#include "image/describe.h"
#include "image/format.h"
#include "image/json.h"
#include "image/path.h"
#include "tools/cmd.h"

namespace qcowfs::tools {
namespace {

struct InfoArgs : ImageCommandArgs {
  bool backing_chain = false;
};

Result<InfoArgs> parse_info_args(std::span<const std::string> args) {
  InfoArgs a;
  QCOWFS_TRY(parse_image_command(args, a, [&](std::span<const std::string> as, size_t& i) -> Result<bool> {
    if (as[i] != "--backing-chain") return false;
    a.backing_chain = true;
    return true;
  }));
  return a;
}

// Everything info prints about one image: its name and format, and what the
// format describes (image/describe.h).
struct ImageInfo {
  std::string filename;
  std::string format;
  image::ImageDescription desc;
  std::string full_backing;  // the backing file's name resolved against filename's directory
  const image::ImageDetails& details() const { return desc.details; }
};

// backing_of: the overlay whose backing file path is ("" for the image named).
Task<Result<ImageInfo>> gather(const std::string& path, const std::string& format_hint, const std::string& backing_of,
                               io::OpenOptions file_options) {
  auto image = co_await open_image_file(path, file_options, format_hint, backing_of);
  if (!image) co_return image.status();
  ImageInfo info;
  info.filename = path;
  info.format = image->format;
  image::ImageOptions opts;
  opts.format = info.format;
  opts.file = file_options;  // the other files it opens (VMDK extents, data files) as the image
  auto desc = co_await image::describe_image(*image::find_format(info.format), std::move(image->file), path, opts);
  if (!desc) co_return desc.status();
  info.desc = std::move(*desc);
  if (!info.details().backing_file.empty())
    info.full_backing = image::resolve_relative(info.filename, info.details().backing_file);
  co_return info;
}

Json snapshot_json(const image::SnapshotListing& s) {
  Json j = Json::object();
  if (s.icount) j.set("icount", *s.icount);
  j.set("vm-clock-nsec", s.vm_clock_nsec % 1000000000);
  j.set("name", s.name);
  j.set("date-sec", uint64_t{s.date_sec});
  j.set("date-nsec", uint64_t{s.date_nsec});
  j.set("vm-clock-sec", s.vm_clock_nsec / 1000000000);
  j.set("id", s.id);
  j.set("vm-state-size", s.vm_state_size);
  return j;
}

Json info_json(const ImageInfo& info) {
  const image::ImageDetails& d = info.details();
  Json j = Json::object();
  if (!info.desc.snapshots.empty()) {
    Json list = Json::array();
    for (const auto& s : info.desc.snapshots) list.push(snapshot_json(s));
    j.set("snapshots", std::move(list));
  }
  if (!d.backing_format.empty()) j.set("backing-filename-format", d.backing_format);
  j.set("virtual-size", info.desc.virtual_size);
  j.set("filename", info.filename);
  if (d.cluster_size != 0) j.set("cluster-size", d.cluster_size);
  j.set("format", info.format);
  j.set("actual-size", info.desc.actual_size);
  if (!d.specific.empty()) {
    Json spec = Json::object();
    spec.set("type", info.format);
    spec.set("data", d.specific);
    j.set("format-specific", std::move(spec));
  }
  if (!d.backing_file.empty()) {
    j.set("full-backing-filename", info.full_backing);
    j.set("backing-filename", d.backing_file);
  }
  if (d.encrypted) j.set("encrypted", true);
  if (d.dirty) j.set("dirty-flag", *d.dirty);
  return j;
}

std::string clock_text(uint64_t ns) {
  uint64_t secs = ns / 1000000000;
  return fmt::format("{:02}:{:02}:{:02}.{:03}", secs / 3600, (secs / 60) % 60, secs % 60, (ns / 1000000) % 1000);
}

std::string date_text(uint32_t sec) {
  std::time_t t = sec;
  std::tm tm{};
  ::localtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", &tm);
  return buf;
}

void print_snapshots(const std::vector<image::SnapshotListing>& snapshots) {
  fmt::print("Snapshot list:\n{:<9} {:<17} {:>7}{:>20}{:>13}{:>11}\n", "ID", "TAG", "VM SIZE", "DATE", "VM CLOCK", "ICOUNT");
  for (const auto& s : snapshots)
    fmt::print("{:<9} {:<17} {:>7} {:>19} {:>12} {:>10}\n", s.id, s.name, human_size(s.vm_state_size),
               date_text(s.date_sec), clock_text(s.vm_clock_nsec),
               s.icount ? fmt::format("{}", *s.icount) : std::string("--"));
}

// qemu-img's human rendering of format-specific data (dump_qobject): one
// "key: value" line per member, dashes in keys as spaces, nested objects and
// lists indented by four spaces, list members as [N].
void print_specific(const Json& j, int level) {
  const std::string pad(static_cast<size_t>(level) * 4, ' ');
  auto print_member = [&](const std::string& label, const Json& v) {
    if (v.is_container()) {
      fmt::print("{}{}:\n", pad, label);
      print_specific(v, level + 1);
    } else {
      fmt::print("{}{}: {}\n", pad, label, v.scalar_text());
    }
  };
  if (j.is_array()) {
    size_t i = 0;
    for (const Json& v : j.items()) print_member(fmt::format("[{}]", i++), v);
    return;
  }
  for (const auto& [key, v] : j.members()) {
    std::string label = key;
    std::replace(label.begin(), label.end(), '-', ' ');
    print_member(label, v);
  }
}

void print_human(const ImageInfo& info) {
  const image::ImageDetails& d = info.details();
  fmt::print("image: {}\nfile format: {}\n", info.filename, info.format);
  fmt::print("virtual size: {} ({} bytes)\n", human_size(info.desc.virtual_size), info.desc.virtual_size);
  fmt::print("disk size: {}\n", human_size(info.desc.actual_size));
  if (d.encrypted) fmt::print("encrypted: yes\n");
  if (d.cluster_size != 0) fmt::print("cluster_size: {}\n", d.cluster_size);
  if (!d.backing_file.empty()) {
    fmt::print("backing file: {}", d.backing_file);
    if (info.full_backing != d.backing_file) fmt::print(" (actual path: {})", info.full_backing);
    fmt::print("\n");
    if (!d.backing_format.empty()) fmt::print("backing file format: {}\n", d.backing_format);
  }
  if (d.dirty.value_or(false)) fmt::print("cleanly shut down: no\n");
  if (!info.desc.snapshots.empty()) print_snapshots(info.desc.snapshots);
  if (!d.specific.empty()) {
    fmt::print("Format specific information:\n");
    print_specific(d.specific, 1);
  }
}

// The image and, with --backing-chain, each backing file in turn.
Task<Result<std::vector<ImageInfo>>> gather_chain(const InfoArgs& a) {
  std::vector<ImageInfo> chain;
  std::string path = a.image, format = a.format;
  for (;;) {
    for (const auto& seen : chain)
      if (seen.filename == path) co_return Status::errorf(ELOOP, "backing file chain loops back to {}", path);
    // A named local, not a conditional temporary: GCC 12 miscompiles those inside co_await.
    std::string overlay;
    if (!chain.empty()) overlay = chain.back().filename;
    auto info = co_await gather(path, format, overlay, a.read_options());
    if (!info) co_return info.status();
    chain.push_back(std::move(*info));
    const ImageInfo& last = chain.back();
    if (!a.backing_chain || last.details().backing_file.empty()) co_return chain;
    path = last.full_backing;
    format = last.details().backing_format;
  }
}

void print_chain(const InfoArgs& a, const std::vector<ImageInfo>& chain) {
  if (a.json && !a.backing_chain) {
    fmt::print("{}\n", info_json(chain.front()).render());
  } else if (a.json) {
    Json list = Json::array();
    for (const auto& i : chain) list.push(info_json(i));
    fmt::print("{}\n", list.render());
  } else {
    for (size_t i = 0; i < chain.size(); ++i) {
      if (i) fmt::print("\n");
      print_human(chain[i]);
    }
  }
}

}  // namespace

std::string_view info_usage() {
  return "usage: qcowfs info [--json] [--backing-chain] [-f FORMAT] [-U] IMAGE\n"
         "\n"
         "Shows what qemu-img info shows: format, virtual and disk size, cluster size,\n"
         "backing file and its format, snapshots, bitmaps, feature bits (compat, lazy\n"
         "refcounts, refcount bits, compression type, extended L2, data file), dirty and\n"
         "corrupt flags.\n"
         "\n"
         "  --json               JSON with qemu-img's field names (--output=json)\n"
         "  --backing-chain      also describe every image of the backing chain\n"
         "  -f, --format=FMT     image format (default: probed)\n"
         "  -U, --force-share    read an image another process (a VM, a rw mount) is writing\n"
         "                       (its locks are shared; what is read may be inconsistent)\n"
         "  -h, --help           show this text\n";
}

int cmd_info(std::span<const std::string> args) {
  return run_tool("info", info_usage(), parse_info_args(args), [](const InfoArgs& a, io::Engine& engine) {
    auto chain = io::run_sync(engine, gather_chain(a));
    if (!chain) return cmd_fail("info", chain.status());
    print_chain(a, *chain);
    return 0;
  });
}

}  // namespace qcowfs::tools
