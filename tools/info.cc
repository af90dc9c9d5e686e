// qcowfs info: what `qemu-img info` shows about an image (and with
// --backing-chain, about every image of its chain), as text or as JSON with
// qemu-img's --output=json field names.
#include <algorithm>
#include <cstdio>
#include <ctime>

#include "image/crypto/unlock.h"
#include "image/endian.h"
#include "image/format.h"
#include "image/path.h"
#include "io/buffer.h"
#include "image/qcow2/qcow2_inspect.h"
#include "tools/cmd.h"
#include "image/json.h"

namespace qcowfs::tools {
namespace {

namespace q = image::qcow2;

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

// Everything info prints about one image.
struct ImageInfo {
  std::string filename;
  std::string format;
  uint64_t virtual_size = 0;
  uint64_t actual_size = 0;
  bool dirty = false;
  // Every format but raw and qcow2: what its driver describes (cluster size,
  // backing file, dirty flag, format-specific data).
  bool described = false;
  image::ImageDetails details;
  // qcow2 only
  bool qcow2 = false;
  q::Header header;
  std::vector<q::Snapshot> snapshots;
  std::vector<q::Bitmap> bitmaps;
  std::string full_backing;
  // Encrypted images: qemu-img's "encrypted: yes" and the qcow2 "encrypt"
  // block (read from the header alone, no key needed).
  bool encrypted = false;
  Json encrypt;
};

// qcow2's "encrypt" block: {"format": "aes"} or the LUKS area's header.
Task<Status> add_qcow2_encryption(io::HostFile& f, const q::Header& h, ImageInfo& info) {
  if (h.crypt_method == q::kCryptNone) co_return Status::ok();
  info.encrypted = true;
  if (h.crypt_method == q::kCryptAes || !h.crypto) {
    info.encrypt.set("format", "aes");
    co_return Status::ok();
  }
  if (h.crypto->length > image::crypto::kMaxLuksHeaderBytes)
    co_return Status::errorf(EINVAL, "{}: LUKS area of {} bytes is larger than the limit of {}", info.filename,
                             h.crypto->length, image::crypto::kMaxLuksHeaderBytes);
  io::AlignedBuffer area(static_cast<size_t>(h.crypto->length), f.mem_align(), true);
  auto n = co_await f.read(h.crypto->offset, area.span());
  if (!n) co_return n.status();
  auto vol = image::crypto::LuksVolume::open_bytes(area.span(), info.filename);
  if (!vol) co_return vol.status();
  info.encrypt = image::crypto::luks_details(vol->info(), true);
  co_return Status::ok();
}

// A raw LUKS image: its header alone, as qemu-img info reads it without a key.
Task<Status> add_luks_info(io::HostFile& f, ImageInfo& info) {
  auto vol = co_await image::crypto::LuksVolume::open_file(f, info.filename);
  if (!vol) co_return vol.status();
  const uint64_t payload = vol->info().payload_offset;
  info.described = true;
  info.encrypted = true;
  info.virtual_size = f.size() > payload ? f.size() - payload : 0;
  info.details.dirty = false;
  info.details.specific = image::crypto::luks_details(vol->info(), false);
  co_return Status::ok();
}

Task<Status> add_qcow2_info(io::HostFile& f, ImageInfo& info) {
  auto h = co_await q::read_qcow2_header(f);
  if (!h) co_return h.status();
  info.qcow2 = true;
  info.header = *h;
  info.virtual_size = h->size;
  info.dirty = h->dirty();
  auto sn = co_await q::read_qcow2_snapshots(f, *h);
  if (!sn) co_return sn.status();
  info.snapshots = std::move(sn->snapshots);
  auto bm = co_await q::read_qcow2_bitmaps(f, *h);
  if (!bm) co_return bm.status();
  info.bitmaps = std::move(*bm);
  if (!h->backing_file.empty()) info.full_backing = image::resolve_relative(info.filename, h->backing_file);
  co_return co_await add_qcow2_encryption(f, *h, info);
}

// The other formats describe themselves through their driver, opened alone
// (without its backing file, as qemu-img info opens it).
Task<Status> add_driver_info(std::unique_ptr<io::HostFile> f, io::OpenOptions file_options, ImageInfo& info) {
  image::ImageOptions opts;
  opts.format = info.format;
  opts.file = file_options;  // the other files it opens (VMDK extents, data files) as the image
  opts.no_backing = true;
  auto d = co_await image::find_format(info.format)->open(std::move(f), info.filename, opts);
  if (!d) co_return d.status();
  info.described = true;
  info.virtual_size = (*d)->size();
  info.actual_size = (*d)->allocated_bytes();  // every file of the image (VMDK extents), as qemu-img adds them
  info.details = (*d)->details();
  info.dirty = info.details.dirty.value_or(false);
  if (!info.details.backing_file.empty())
    info.full_backing = image::resolve_relative(info.filename, info.details.backing_file);
  co_return co_await (*d)->close();
}

// backing_of: the overlay whose backing file path is ("" for the image named).
Task<Result<ImageInfo>> gather(const std::string& path, const std::string& format_hint, const std::string& backing_of,
                               io::OpenOptions file_options) {
  auto image = co_await open_image_file(path, file_options, format_hint, backing_of);
  if (!image) co_return image.status();
  io::HostFile& f = *image->file;
  ImageInfo info;
  info.filename = path;
  info.format = image->format;
  info.actual_size = f.allocated_bytes();
  info.virtual_size = f.size();
  if (info.format == "qcow2") {
    QCOWFS_CO_TRY(co_await add_qcow2_info(f, info));
  } else if (info.format == "luks") {
    QCOWFS_CO_TRY(co_await add_luks_info(f, info));
  } else if (info.format != "raw") {
    QCOWFS_CO_TRY(co_await add_driver_info(std::move(image->file), file_options, info));
  }
  co_return info;
}

uint64_t snapshot_icount(const q::Snapshot& s) {
  if (s.extra.size() < sizeof(q::SnapshotExtraLayout)) return ~uint64_t{0};
  return image::load_be64(s.extra.data() + offsetof(q::SnapshotExtraLayout, icount));
}

Json snapshot_json(const q::Snapshot& s) {
  Json j = Json::object();
  uint64_t icount = snapshot_icount(s);
  if (icount != ~uint64_t{0}) j.set("icount", icount);
  j.set("vm-clock-nsec", s.vm_clock_nsec % 1000000000);
  j.set("name", s.name);
  j.set("date-sec", uint64_t{s.date_sec});
  j.set("date-nsec", uint64_t{s.date_nsec});
  j.set("vm-clock-sec", s.vm_clock_nsec / 1000000000);
  j.set("id", s.id);
  j.set("vm-state-size", s.vm_state_size);
  return j;
}

Json bitmap_json(const q::Bitmap& b) {
  Json flags = Json::array();
  if (b.flags & q::kBitmapFlagInUse) flags.push("in-use");
  if (b.flags & q::kBitmapFlagAuto) flags.push("auto");
  Json j = Json::object();
  j.set("flags", std::move(flags));
  j.set("name", b.name);
  j.set("granularity", b.granularity());
  return j;
}

std::string compression_name(uint8_t t) { return t == q::kCompressionZstd ? "zstd" : "zlib"; }

Json qcow2_specific(const ImageInfo& info) {
  const q::Header& h = info.header;
  Json d = Json::object();
  if (h.version == 2) {
    d.set("compat", "0.10");
    d.set("compression-type", compression_name(h.compression_type));
    d.set("refcount-bits", uint64_t{h.refcount_bits()});
    if (info.encrypted) d.set("encrypt", info.encrypt);
    return d;
  }
  d.set("compat", "1.1");
  d.set("compression-type", compression_name(h.compression_type));
  d.set("lazy-refcounts", (h.compatible_features & q::kCompatLazyRefcounts) != 0);
  if (!info.bitmaps.empty()) {
    Json list = Json::array();
    for (const auto& b : info.bitmaps) list.push(bitmap_json(b));
    d.set("bitmaps", std::move(list));
  }
  d.set("refcount-bits", uint64_t{h.refcount_bits()});
  if (info.encrypted) d.set("encrypt", info.encrypt);
  if (h.has_data_file_name) d.set("data-file", h.data_file);
  if (h.has_external_data_file()) d.set("data-file-raw", h.data_file_raw());
  d.set("corrupt", h.corrupt());
  d.set("extended-l2", h.extended_l2());
  return d;
}

uint64_t cluster_size(const ImageInfo& info) {
  return info.qcow2 ? info.header.cluster_size() : info.details.cluster_size;
}

const std::string& backing_file(const ImageInfo& info) {
  return info.qcow2 ? info.header.backing_file : info.details.backing_file;
}

Json info_json(const ImageInfo& info) {
  Json j = Json::object();
  if (!info.snapshots.empty()) {
    Json list = Json::array();
    for (const auto& s : info.snapshots) list.push(snapshot_json(s));
    j.set("snapshots", std::move(list));
  }
  const std::string& backing_format = info.qcow2 ? info.header.backing_format : info.details.backing_format;
  if (!backing_format.empty()) j.set("backing-filename-format", backing_format);
  j.set("virtual-size", info.virtual_size);
  j.set("filename", info.filename);
  if (cluster_size(info) != 0) j.set("cluster-size", cluster_size(info));
  j.set("format", info.format);
  j.set("actual-size", info.actual_size);
  if (info.qcow2 || !info.details.specific.empty()) {
    Json spec = Json::object();
    spec.set("type", info.format);
    spec.set("data", info.qcow2 ? qcow2_specific(info) : info.details.specific);
    j.set("format-specific", std::move(spec));
  }
  if (!backing_file(info).empty()) {
    j.set("full-backing-filename", info.full_backing);
    j.set("backing-filename", backing_file(info));
  }
  if (info.encrypted) j.set("encrypted", true);
  if (!info.described || info.details.dirty) j.set("dirty-flag", info.dirty);
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

void print_snapshots(const std::vector<q::Snapshot>& snapshots) {
  fmt::print("Snapshot list:\n{:<9} {:<17} {:>7}{:>20}{:>13}{:>11}\n", "ID", "TAG", "VM SIZE", "DATE", "VM CLOCK", "ICOUNT");
  for (const auto& s : snapshots) {
    uint64_t icount = snapshot_icount(s);
    fmt::print("{:<9} {:<17} {:>7} {:>19} {:>12} {:>10}\n", s.id, s.name, human_size(s.vm_state_size),
               date_text(s.date_sec), clock_text(s.vm_clock_nsec),
               icount == ~uint64_t{0} ? std::string("--") : fmt::format("{}", icount));
  }
}

void print_specific(const Json& j, int level);

void print_qcow2_encrypt(const ImageInfo& info) {
  if (!info.encrypted) return;
  fmt::print("    encrypt:\n");
  print_specific(info.encrypt, 2);
}

void print_qcow2_specific(const ImageInfo& info) {
  const q::Header& h = info.header;
  fmt::print("Format specific information:\n");
  fmt::print("    compat: {}\n", h.version == 2 ? "0.10" : "1.1");
  fmt::print("    compression type: {}\n", compression_name(h.compression_type));
  if (h.version == 2) {
    fmt::print("    refcount bits: {}\n", h.refcount_bits());
    print_qcow2_encrypt(info);
    return;
  }
  fmt::print("    lazy refcounts: {}\n", (h.compatible_features & q::kCompatLazyRefcounts) != 0);
  if (!info.bitmaps.empty()) {
    fmt::print("    bitmaps:\n");
    for (const auto& b : info.bitmaps) {
      fmt::print("        [{}]:\n            flags:\n", &b - info.bitmaps.data());
      int n = 0;
      if (b.flags & q::kBitmapFlagInUse) fmt::print("                [{}]: in-use\n", n++);
      if (b.flags & q::kBitmapFlagAuto) fmt::print("                [{}]: auto\n", n++);
      fmt::print("            name: {}\n            granularity: {}\n", b.name, b.granularity());
    }
  }
  fmt::print("    refcount bits: {}\n", h.refcount_bits());
  print_qcow2_encrypt(info);
  if (h.has_data_file_name) fmt::print("    data file: {}\n", h.data_file);
  if (h.has_external_data_file()) fmt::print("    data file raw: {}\n", h.data_file_raw());
  fmt::print("    corrupt: {}\n    extended l2: {}\n", h.corrupt(), h.extended_l2());
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
  fmt::print("image: {}\nfile format: {}\n", info.filename, info.format);
  fmt::print("virtual size: {} ({} bytes)\n", human_size(info.virtual_size), info.virtual_size);
  fmt::print("disk size: {}\n", human_size(info.actual_size));
  if (info.encrypted) fmt::print("encrypted: yes\n");
  if (cluster_size(info) != 0) fmt::print("cluster_size: {}\n", cluster_size(info));
  if (!backing_file(info).empty()) {
    fmt::print("backing file: {}", backing_file(info));
    if (info.full_backing != backing_file(info)) fmt::print(" (actual path: {})", info.full_backing);
    fmt::print("\n");
    const std::string& bf = info.qcow2 ? info.header.backing_format : info.details.backing_format;
    if (!bf.empty()) fmt::print("backing file format: {}\n", bf);
  }
  if (info.dirty) fmt::print("cleanly shut down: no\n");
  if (!info.snapshots.empty()) print_snapshots(info.snapshots);
  if (info.qcow2) print_qcow2_specific(info);
  if (!info.details.specific.empty()) {
    fmt::print("Format specific information:\n");
    print_specific(info.details.specific, 1);
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
    if (!a.backing_chain || backing_file(last).empty()) co_return chain;
    path = last.full_backing;
    format = last.qcow2 ? last.header.backing_format : last.details.backing_format;
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
