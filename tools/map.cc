// qcowfs map: the allocation map of an image, printed as `qemu-img map` (QEMU
// 7.2) prints it, built from BlockDriver::block_status over the whole disk
// (backing chain included). Neighbouring ranges are merged by qemu-img's rule:
// same flags, depth and file, and host offsets that continue each other.
#include <cstdio>

#include "image/block_driver.h"
#include "image/crypto/secret.h"
#include "tools/cmd.h"
#include "image/json.h"

namespace qcowfs::tools {
namespace {

struct MapArgs : ImageCommandArgs {};

Result<MapArgs> parse_map_args(std::span<const std::string> args) {
  MapArgs a;
  QCOWFS_TRY(parse_image_command(args, a, [](std::span<const std::string>, size_t&) -> Result<bool> {
    return false;  // map has no options of its own
  }));
  return a;
}

struct Extent {
  uint64_t start = 0;
  uint64_t length = 0;
  image::BlockStatus status;  // status.length is not used
  std::string file;           // path of status.file ("" without one)
};

bool has_offset(const Extent& e) { return e.status.file != nullptr; }

// qemu-img's entry_mergeable().
bool mergeable(const Extent& cur, const Extent& next) {
  const image::BlockStatus& a = cur.status;
  const image::BlockStatus& b = next.status;
  if (a.zero != b.zero || a.data != b.data || a.depth != b.depth || a.present != b.present) return false;
  if (has_offset(cur) != has_offset(next) || cur.file != next.file) return false;
  return !has_offset(cur) || a.host_offset + cur.length == b.host_offset;
}

Task<Result<std::vector<Extent>>> build_map(const MapArgs& a) {
  image::ImageOptions o;
  o.format = a.format;
  o.file = a.read_options();
  o.keys = key_provider(a.key_file);
  auto d = co_await image::open_image(a.image, o);
  if (!d) co_return d.status();
  std::vector<Extent> out;
  uint64_t size = (*d)->size();
  for (uint64_t off = 0; off < size;) {
    auto st = co_await (*d)->block_status(off, size - off);
    if (!st) co_return st.status();
    if (st->length == 0) co_return Status::errorf(EIO, "block status at {:#x} returned an empty range", off);
    Extent e{off, st->length, *st, st->file ? st->file->path() : std::string()};
    if (!out.empty() && mergeable(out.back(), e)) out.back().length += e.length;
    else out.push_back(std::move(e));
    off += st->length;
  }
  QCOWFS_CO_TRY(co_await (*d)->close());
  co_return out;
}

Json extent_json(const Extent& e) {
  Json j = Json::object();
  j.set("start", e.start);
  j.set("length", e.length);
  j.set("depth", e.status.depth);
  j.set("present", e.status.present);
  j.set("zero", e.status.zero);
  j.set("data", e.status.data);
  if (has_offset(e)) j.set("offset", e.status.host_offset);
  return j;
}

void print_json(const std::vector<Extent>& map) {
  if (map.empty()) {  // an empty disk: qemu-img prints its one empty entry
    fmt::print("[{}]\n", extent_json(Extent{}).render_compact());
    return;
  }
  fmt::print("[");
  for (size_t i = 0; i < map.size(); ++i) fmt::print("{}{}", i ? ",\n" : "", extent_json(map[i]).render_compact());
  fmt::print("]\n");
}

// printf's "%#x": no 0x prefix for zero.
std::string hex(uint64_t v) { return v == 0 ? "0" : fmt::format("{:#x}", v); }

// The human form lists the ranges holding data that is not known to be zero,
// with where they are stored; like qemu-img it fails at the first data range
// without a host offset (compressed clusters).
int print_human(const std::vector<Extent>& map) {
  fmt::print("{:<16}{:<16}{:<16}{}\n", "Offset", "Length", "Mapped to", "File");
  for (const auto& e : map) {
    if (e.status.data && !has_offset(e)) {
      std::fflush(stdout);
      return cmd_fail("map", Status::error(EINVAL, "File contains external, encrypted or compressed clusters."));
    }
    if (e.status.data && !e.status.zero)
      fmt::print("{:<16}{:<16}{:<16}{}\n", hex(e.start), hex(e.length), hex(e.status.host_offset), e.file);
  }
  return 0;
}

}  // namespace

std::string_view map_usage() {
  return "usage: qcowfs map [--json] [-f FORMAT] [--key-file PATH] [-U] IMAGE\n"
         "\n"
         "Prints the allocation map of the guest disk as qemu-img map does. The default\n"
         "form lists the ranges holding data with their host offset and the file that\n"
         "stores them (fails on compressed clusters, which have no host offset); --json\n"
         "lists every range: depth in the backing chain (0 = the image itself), whether\n"
         "a layer records it (present), reads as zeros, holds data, and its host offset.\n"
         "\n"
         "  --json               one JSON object per range (--output=json)\n"
         "  -f, --format=FMT     image format (default: probed)\n"
         "  --key-file=PATH      passphrase of an encrypted image (the file's content, - for\n"
         "                       standard input; default: asked on the terminal)\n"
         "  -U, --force-share    read an image another process (a VM, a rw mount) is writing\n"
         "                       (its locks are shared; what is read may be inconsistent)\n"
         "  -h, --help           show this text\n";
}

int cmd_map(std::span<const std::string> args) {
  return run_tool("map", map_usage(), parse_map_args(args), [](const MapArgs& a, io::Engine& engine) {
    auto map = io::run_sync(engine, build_map(a));
    if (!map) return cmd_fail("map", map.status());
    if (!a.json) return print_human(*map);
    print_json(*map);
    return 0;
  });
}

}  // namespace qcowfs::tools
