// `qcowfs info` on a qcow2 image (image/qcow2/qcow2.h): the header, snapshot
// table, bitmap directory and LUKS header read straight from the file
// (qcow2_inspect.h), without a key and without the backing file, as qemu-img
// info reads them; "format-specific" in qemu-img's field order.
#include <cstddef>

#include "image/crypto/luks.h"
#include "image/crypto/unlock.h"
#include "image/endian.h"
#include "image/qcow2/bitmaps.h"
#include "image/qcow2/format.h"
#include "image/qcow2/qcow2.h"
#include "image/qcow2/qcow2_inspect.h"
#include "io/buffer.h"

namespace qcowfs::image::qcow2 {
namespace {

// The snapshot's instruction count from its extra data, when recorded.
std::optional<uint64_t> snapshot_icount(const Snapshot& s) {
  if (s.extra.size() < sizeof(SnapshotExtraLayout)) return std::nullopt;
  const uint64_t icount = load_be64(s.extra.data() + offsetof(SnapshotExtraLayout, icount));
  if (icount == ~uint64_t{0}) return std::nullopt;
  return icount;
}

SnapshotListing snapshot_listing(const Snapshot& s) {
  return SnapshotListing{.id = s.id,
                         .name = s.name,
                         .vm_state_size = s.vm_state_size,
                         .date_sec = s.date_sec,
                         .date_nsec = s.date_nsec,
                         .vm_clock_nsec = s.vm_clock_nsec,
                         .icount = snapshot_icount(s)};
}

// qcow2's "encrypt" block: {"format": "aes"} or the LUKS area's header.
Task<Result<Json>> encryption_json(io::HostFile& f, const Header& h, const std::string& path) {
  Json j = Json::object();
  if (h.crypt_method == kCryptAes || !h.crypto) {
    j.set("format", "aes");
    co_return j;
  }
  if (h.crypto->length > crypto::kMaxLuksHeaderBytes)
    co_return Status::errorf(EINVAL, "{}: LUKS area of {} bytes is larger than the limit of {}", path,
                             h.crypto->length, crypto::kMaxLuksHeaderBytes);
  io::AlignedBuffer area(static_cast<size_t>(h.crypto->length), f.mem_align(), true);
  auto n = co_await f.read(h.crypto->offset, area.span());
  if (!n) co_return n.status();
  auto vol = crypto::LuksVolume::open_bytes(area.span(), path);
  if (!vol) co_return vol.status();
  co_return crypto::luks_details(vol->info(), true);
}

Json bitmap_json(const BitmapDirEntry& b) {
  Json flags = Json::array();
  if (b.flags & kBitmapFlagInUse) flags.push("in-use");
  if (b.flags & kBitmapFlagAuto) flags.push("auto");
  Json j = Json::object();
  j.set("flags", std::move(flags));
  j.set("name", b.name);
  j.set("granularity", b.granularity());
  return j;
}

std::string compression_name(uint8_t t) { return t == kCompressionZstd ? "zstd" : "zlib"; }

// encrypt: the "encrypt" block of an encrypted image, else nullopt.
Json specific_json(const Header& h, const std::vector<BitmapDirEntry>& bitmaps, const std::optional<Json>& encrypt) {
  Json d = Json::object();
  if (h.version == 2) {
    d.set("compat", "0.10");
    d.set("compression-type", compression_name(h.compression_type));
    d.set("refcount-bits", uint64_t{h.refcount_bits()});
    if (encrypt) d.set("encrypt", *encrypt);
    return d;
  }
  d.set("compat", "1.1");
  d.set("compression-type", compression_name(h.compression_type));
  d.set("lazy-refcounts", (h.compatible_features & kCompatLazyRefcounts) != 0);
  if (!bitmaps.empty()) {
    Json list = Json::array();
    for (const auto& b : bitmaps) list.push(bitmap_json(b));
    d.set("bitmaps", std::move(list));
  }
  d.set("refcount-bits", uint64_t{h.refcount_bits()});
  if (encrypt) d.set("encrypt", *encrypt);
  if (h.has_data_file_name) d.set("data-file", h.data_file);
  if (h.has_external_data_file()) d.set("data-file-raw", h.data_file_raw());
  d.set("corrupt", h.corrupt());
  d.set("extended-l2", h.extended_l2());
  return d;
}

}  // namespace
}  // namespace qcowfs::image::qcow2

namespace qcowfs::image {

Task<Result<ImageDescription>> describe_qcow2(std::unique_ptr<io::HostFile> file, std::string path,
                                              ImageOptions /*opts*/) {
  using namespace qcow2;
  io::HostFile& f = *file;
  auto h = co_await read_qcow2_header(f);
  if (!h) co_return h.status();
  auto sn = co_await read_qcow2_snapshots(f, *h);
  if (!sn) co_return sn.status();
  // As qemu-img info (which opens the image): a directory QEMU refuses is an error.
  auto loaded = co_await PersistentBitmaps::load(f, *h, false);
  if (!loaded) co_return loaded.status().with_context(path);
  const std::vector<BitmapDirEntry> bitmaps = (*loaded)->entries();
  std::optional<Json> encrypt;
  if (h->crypt_method != kCryptNone) {
    auto e = co_await encryption_json(f, *h, path);
    if (!e) co_return e.status();
    encrypt = std::move(*e);
  }
  ImageDescription d;
  d.virtual_size = h->size;
  d.actual_size = f.allocated_bytes();
  d.details.cluster_size = h->cluster_size();
  d.details.backing_file = h->backing_file;
  d.details.backing_format = h->backing_format;
  d.details.dirty = h->dirty();
  d.details.encrypted = encrypt.has_value();
  d.details.specific = specific_json(*h, bitmaps, encrypt);
  for (const Snapshot& s : sn->snapshots) d.snapshots.push_back(snapshot_listing(s));
  co_return d;
}

}  // namespace qcowfs::image
