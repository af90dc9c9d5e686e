// Opening a qcow2 image: header, L1 table, snapshot table, external data
// file, backing chain and caches, then the writer for a writable image.
#include <algorithm>
#include <bit>

#include "image/backing.h"
#include "image/endian.h"
#include "image/path.h"
#include "image/qcow2/bitmaps.h"
#include "image/qcow2/driver.h"
#include "image/qcow2/qcow2.h"
#include "io/buffer.h"
#include "io/log.h"

namespace qcowfs::image {
namespace qcow2 {
namespace {

Task<Result<io::AlignedBuffer>> read_exact(io::HostFile& f, HostOffset host, size_t len, bool zero_past_eof,
                                           std::string_view what) {
  io::AlignedBuffer buf(len, f.mem_align(), zero_past_eof);
  auto n = co_await f.read(host, buf.span());
  if (!n) co_return n.status().with_context(fmt::format("reading {}", what));
  if (*n < len && !zero_past_eof)
    co_return Status::errorf(EINVAL, "{} at {:#x} ({} bytes) is truncated by the end of the file", what, host, len);
  co_return buf;
}

Task<Result<Header>> read_header(io::HostFile& f) {
  auto probe = co_await read_exact(f, 0, kHeaderProbeBytes, true, "qcow2 header");
  if (!probe) co_return probe.status();
  auto cs = header_cluster_size(probe->span().first(std::min<uint64_t>(f.size(), kHeaderProbeBytes)));
  if (!cs) co_return cs.status();
  auto cluster0 = co_await read_exact(f, 0, static_cast<size_t>(*cs), true, "qcow2 header cluster");
  if (!cluster0) co_return cluster0.status();
  co_return parse_header(cluster0->span(), f.size());
}

Task<Result<std::vector<Snapshot>>> read_snapshots(io::HostFile& f, const Header& h) {
  if (h.nb_snapshots == 0) co_return std::vector<Snapshot>{};
  uint64_t file_size = f.size();
  uint64_t want = std::min<uint64_t>(64 * 1024, file_size - h.snapshots_offset);
  for (;;) {
    auto buf = co_await read_exact(f, h.snapshots_offset, static_cast<size_t>(want), false, "snapshot table");
    if (!buf) co_return buf.status();
    auto t = parse_snapshot_table(buf->span(), h, file_size);
    if (!t) co_return t.status();
    if (t->needed_bytes == 0) co_return std::move(t->snapshots);
    // parse_snapshot_table bounds needed_bytes by the file and the table limit.
    want = std::min(std::max(t->needed_bytes, want * 2), std::min(kMaxSnapshotTableBytes, file_size - h.snapshots_offset));
  }
}

Task<Status> open_data_file(Qcow2Image& img, const ImageOptions& opts) {
  if (!img.header.has_external_data_file()) {
    img.data_file = img.file.get();
    img.data_io = img.data_file;
    co_return Status::ok();
  }
  std::string dpath = resolve_relative(img.path, img.header.data_file);
  auto f = io::open_host_file(dpath, opts.file);
  if (!f) co_return f.status().with_context(fmt::format("opening external data file of {}", img.path));
  img.data_file_owned = std::move(*f);
  img.data_file = img.data_file_owned.get();
  img.data_io = img.data_file;
  co_return Status::ok();
}

// crypt_method 2: the LUKS area unlocked, data through a CryptFile (IVs from
// the host offset, as QEMU's crypt_physical_offset). crypt_method 1: QEMU's
// legacy AES, read-only, IVs from the guest offset (ReadPath::read_data).
Task<Status> open_encryption(Qcow2Image& img, const ImageOptions& opts) {
  const Header& h = img.header;
  if (h.crypt_method == kCryptNone) co_return Status::ok();
  auto keys = crypto::key_provider_or_terminal(opts.keys);
  if (h.crypt_method == kCryptAes) {
    log::warn("{}: qcow2's built-in AES encryption is weak and deprecated (QEMU: \"it is not recommended for use "
              "for data integrity\"); opened read-only. Convert the data to a LUKS-encrypted image.", img.path);
    auto pass = keys->passphrase(img.path);
    if (!pass) co_return pass.status();
    auto c = crypto::SectorCipher::legacy_qcow_aes((*pass)->span());
    if (!c) co_return c.status();
    img.legacy_cipher = std::move(*c);
    co_return Status::ok();
  }
  if (h.crypto->length > crypto::kMaxLuksHeaderBytes)
    co_return Status::errorf(EINVAL, "LUKS area of {} bytes is larger than the limit of {}", h.crypto->length,
                             crypto::kMaxLuksHeaderBytes);
  auto area = co_await read_exact(*img.file, h.crypto->offset, static_cast<size_t>(h.crypto->length), false,
                                  "LUKS area");
  if (!area) co_return area.status();
  auto luks = crypto::unlock_luks_area(area->span(), *keys, img.path);
  if (!luks) co_return luks.status();
  img.crypt_file = std::make_unique<crypto::CryptFile>(*img.data_file, luks->cipher);
  img.data_io = img.crypt_file.get();
  img.luks = std::move(*luks);
  co_return Status::ok();
}

Task<Status> open_backing(Qcow2Image& img, const ImageOptions& opts) {
  if (opts.backing) {  // an image opened already (a throwaway overlay's)
    if (!opts.backing->driver)
      co_return Status::errorf(EINVAL, "{}: the given backing image was taken already", img.path);
    img.backing = std::move(opts.backing->driver);
    co_return Status::ok();
  }
  if (img.header.backing_file.empty() || opts.no_backing) co_return Status::ok();
  auto d = co_await open_backing_file(img.path, img.header.backing_file, img.header.backing_format, opts);
  if (!d) co_return d.status();
  img.backing = std::move(*d);
  co_return Status::ok();
}

void setup_caches(Qcow2Image& img, const ImageOptions& opts) {
  const Header& h = img.header;
  static_assert(std::has_single_bit(TableCache::kDefaultSliceSize));  // Qcow2Image::l2_slice_entries()
  size_t slice = static_cast<size_t>(std::min<uint64_t>(TableCache::kDefaultSliceSize, h.cluster_size()));
  uint64_t whole_disk = h.l1_entries_for(h.size) * h.cluster_size();
  uint64_t bytes = opts.table_cache_size != 0 ? opts.table_cache_size : TableCache::default_size(whole_disk, slice);
  img.l2_cache = std::make_unique<TableCache>(*img.file, slice, bytes);
  img.cluster_cache = std::make_unique<ClusterCache>(ClusterCache::default_capacity(h.cluster_size()));
}

void log_feature_state(const Header& h, const std::string& path) {
  if (h.corrupt()) log::warn("{}: image is marked corrupt; opened read-only, data may be wrong", path);
  if (h.dirty()) log::info("{}: image was not closed cleanly (dirty bit): refcounts are not trusted", path);
}

// The shared state of the image in `file`: header checked, geometry and caches
// set up (no tables read yet).
Task<Result<std::shared_ptr<Qcow2Image>>> load_header(std::unique_ptr<io::HostFile> file, const std::string& path,
                                                      const ImageOptions& opts, bool writable) {
  auto img = std::make_shared<Qcow2Image>();
  img->path = path;
  img->file = std::move(file);
  auto h = co_await read_header(*img->file);
  if (!h) co_return h.status();
  img->header = std::move(*h);
  if (Status st = check_features(img->header, writable); !st) {
    if (writable && img->header.corrupt()) log::error("{}: {}", path, st.message());
    co_return st;
  }
  log_feature_state(img->header, path);
  // A writable image grows while it is open: file-size range checks on
  // entries would reject what the writer just allocated.
  img->geometry = make_geometry(img->header, writable ? kMaxHostOffset : img->file->size());
  setup_caches(*img, opts);
  co_return img;
}

Task<Result<std::unique_ptr<BlockDriver>>> open_impl(std::unique_ptr<io::HostFile> file, std::string path,
                                                     ImageOptions opts) {
  const bool writable = opts.file.writable && file->writable();
  if (writable && !opts.snapshot.empty())
    co_return Status::error(EROFS, "snapshots are read-only: open them without write access");
  if (auto chain = enter_backing_chain(path, opts); !chain) co_return chain.status();
  auto img = co_await load_header(std::move(file), path, opts, writable);
  if (!img) co_return img.status();
  auto l1 = co_await read_l1(*(*img)->file, (*img)->header.l1_table_offset, (*img)->header.l1_size);
  if (!l1) co_return l1.status();
  auto sn = co_await read_snapshots(*(*img)->file, (*img)->header);
  if (!sn) co_return sn.status();
  (*img)->snapshots = std::move(*sn);
  // A bitmap directory or table QEMU refuses makes the open fail, read-only
  // too; the writer loads the bitmaps' data itself (image/qcow2/bitmaps.h).
  // A read-only active image keeps its bitmaps, loaded, for views of them (as
  // QEMU loads them read-only); a backing file or a snapshot only checks them.
  std::unique_ptr<PersistentBitmaps> ro_bitmaps;
  if (!writable) {
    bool keep = opts.backing_of.empty() && opts.snapshot.empty();
    auto bitmaps = co_await PersistentBitmaps::load(*(*img)->file, (*img)->header, keep);
    if (!bitmaps && keep && bitmaps.status().code() == EFBIG) {  // too big to hold: served without them
      log::warn("{}: {}; bitmaps/ is not shown", path, bitmaps.status().message());
      keep = false;
      bitmaps = co_await PersistentBitmaps::load(*(*img)->file, (*img)->header, false);
    }
    if (!bitmaps) co_return bitmaps.status();
    if (keep && !(*bitmaps)->empty()) ro_bitmaps = std::move(*bitmaps);
  }
  QCOWFS_CO_TRY(co_await open_data_file(**img, opts));
  QCOWFS_CO_TRY(co_await open_encryption(**img, opts));
  QCOWFS_CO_TRY(co_await open_backing(**img, opts));
  const uint64_t size = (*img)->header.size;
  auto drv = std::make_unique<Qcow2Driver>(std::move(*img), std::move(*l1), size, false);
  if (ro_bitmaps) drv->keep_bitmaps(std::move(ro_bitmaps));
  if (writable) QCOWFS_CO_TRY(co_await drv->enable_writes(opts));
  if (!opts.snapshot.empty()) co_return co_await drv->open_snapshot(opts.snapshot);
  std::unique_ptr<BlockDriver> out = std::move(drv);
  co_return out;
}

}  // namespace

Task<Result<L1Table>> read_l1(io::HostFile& f, HostOffset offset, uint32_t entries) {
  L1Table l1;
  l1.host_offset = offset;
  if (entries == 0) co_return l1;
  auto buf = co_await read_exact(f, offset, size_t{entries} * L1Table::kEntryBytes, false, "L1 table");
  if (!buf) co_return buf.status();
  l1.entries.resize(entries);
  for (size_t i = 0; i < entries; ++i) l1.entries[i] = load_be64(buf->data() + i * L1Table::kEntryBytes);
  co_return l1;
}

}  // namespace qcow2

Task<Result<std::unique_ptr<BlockDriver>>> open_qcow2(std::unique_ptr<io::HostFile> file, std::string path,
                                                      ImageOptions opts) {
  auto d = co_await qcow2::open_impl(std::move(file), path, std::move(opts));
  if (!d) co_return d.status().with_context(path);
  co_return d;
}

}  // namespace qcowfs::image
