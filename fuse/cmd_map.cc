// qcowfs map: the allocation map of an image, like `qemu-img map`, built from
// BlockDriver::block_status over the whole disk (backing chain included).
// Adjacent ranges with the same status are merged.
#include <cstdio>

#include "fuse/cmd.h"
#include "fuse/cmd_json.h"
#include "image/block_driver.h"

namespace qcowfs::fuse {
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
  image::BlockStatus status;
};

bool same_kind(const image::BlockStatus& a, const image::BlockStatus& b) {
  return a.data == b.data && a.zero == b.zero && a.depth == b.depth;
}

Task<Result<std::vector<Extent>>> build_map(const MapArgs& a) {
  image::ImageOptions o;
  o.format = a.format;
  auto d = co_await image::open_image(a.image, o);
  if (!d) co_return d.status();
  std::vector<Extent> out;
  uint64_t size = (*d)->size();
  for (uint64_t off = 0; off < size;) {
    auto st = co_await (*d)->block_status(off, size - off);
    if (!st) co_return st.status();
    if (st->length == 0) co_return Status::errorf(EIO, "block status at {:#x} returned an empty range", off);
    if (!out.empty() && same_kind(out.back().status, *st)) out.back().length += st->length;
    else out.push_back(Extent{off, st->length, *st});
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
  j.set("present", e.status.data);
  j.set("zero", e.status.zero);
  j.set("data", e.status.data);
  return j;
}

}  // namespace

std::string_view map_usage() {
  return "usage: qcowfs map [--json] [-f FORMAT] IMAGE\n"
         "\n"
         "Prints the allocation map of the guest disk, like qemu-img map: for each range,\n"
         "whether it holds data, reads as zeros, and at which depth of the backing chain\n"
         "(0 = the image itself) it is found.\n"
         "\n"
         "  --json               one JSON object per range (--output=json)\n"
         "  -f, --format=FMT     image format (default: probed)\n"
         "  -h, --help           show this text\n";
}

int cmd_map(std::span<const std::string> args) {
  auto a = parse_map_args(args);
  if (!a) return usage_error("map", a.status().message());
  if (a->help) {
    fmt::print("{}", map_usage());
    return 0;
  }
  auto engine = tool_engine();
  if (!engine) return cmd_fail("map", engine.status());
  auto map = io::run_sync(**engine, build_map(*a));
  if (!map) return cmd_fail("map", map.status());
  if (a->json) {
    fmt::print("[");
    for (size_t i = 0; i < map->size(); ++i) fmt::print("{}{}", i ? ",\n" : "", extent_json((*map)[i]).render_compact());
    fmt::print("]\n");
    return 0;
  }
  fmt::print("{:<16}{:<16}{}\n", "Offset", "Length", "Depth");
  for (const auto& e : *map)
    if (e.status.data) fmt::print("{:<#16x}{:<#16x}{}\n", e.start, e.length, e.status.depth);
  return 0;
}

}  // namespace qcowfs::fuse
