// open_parallels(): QEMU 7.2's parallels_open() (block/parallels.c) for a
// read-only open over our HostFile: header checks, the BAT, the format
// extension's checks, then an ExtentDriver over a ClusterMap.
#include "image/parallels/parallels.h"

#include <gcrypt.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <vector>

#include "image/crypto/cipher.h"
#include "image/endian.h"
#include "image/extent/driver.h"
#include "image/extent/host_read.h"
#include "image/parallels/format.h"
#include "image/parallels/header.h"
#include "image/parallels/map.h"
#include "image/parallels/writer.h"

namespace qcowfs::image {
namespace {

using parallels::kSector;

// The BAT entries that lie inside the file, in host order.
Task<Result<std::vector<uint32_t>>> read_bat(io::HostFile& file, const parallels::Header& h, const std::string& path) {
  const uint64_t fsize = file.size();
  const uint64_t in_file = fsize > parallels::kBatOff ? (fsize - parallels::kBatOff) / 4 : 0;
  const uint64_t n = std::min<uint64_t>(h.bat_entries, in_file);
  if (n > parallels::kMaxBatInMemory)
    co_return Status::errorf(EFBIG, "{}: Parallels BAT of {} entries is past qcowfs's limit of {} ({} MiB)", path, n,
                             parallels::kMaxBatInMemory, parallels::kMaxBatInMemory * 4 >> 20);
  std::vector<uint32_t> bat(n);
  std::span<std::byte> raw(reinterpret_cast<std::byte*>(bat.data()), n * 4);
  QCOWFS_CO_TRY(co_await read_padded(file, parallels::kBatOff, raw, "Parallels BAT"));
  for (uint32_t& e : bat) e = load_le32(reinterpret_cast<const std::byte*>(&e));
  co_return bat;
}

// libgcrypt's MD5 context, closed when it goes.
struct Md5Close {
  void operator()(gcry_md_hd_t h) const { gcry_md_close(h); }
};
using Md5Handle = std::unique_ptr<gcry_md_handle, Md5Close>;

// The MD5 of the extension cluster after its header (libgcrypt, fed in chunks
// read with zeros past the end of the file), against the one the header records.
Task<Status> check_extension_md5(io::HostFile& file, uint64_t at, uint64_t cluster_size,
                                 std::span<const std::byte> first, const std::string& path) {
  crypto::init_gcrypt();
  gcry_md_hd_t raw = nullptr;
  if (const gcry_error_t e = gcry_md_open(&raw, GCRY_MD_MD5, 0); e != 0)
    co_return Status::errorf(EIO, "{}: MD5 of the Parallels format extension: {}", path, gcry_strerror(e));
  const Md5Handle md5(raw);
  std::vector<std::byte> chunk(parallels::kMaxExtRead);
  for (uint64_t off = parallels::kExtHeaderSize; off < cluster_size;) {
    const uint64_t n = std::min<uint64_t>(chunk.size(), cluster_size - off);
    std::span<std::byte> part(chunk.data(), n);
    QCOWFS_CO_TRY(co_await read_padded(file, at + off, part, "Parallels format extension"));
    gcry_md_write(md5.get(), part.data(), part.size());
    off += n;
  }
  if (std::memcmp(gcry_md_read(md5.get(), GCRY_MD_MD5), first.data() + 8, 16) != 0)
    co_return Status::errorf(EINVAL, "{}: wrong checksum in the Parallels format extension header: it is corrupted",
                             path);
  co_return Status::ok();
}

// A read-only open reads the format extension and fails where it is corrupt
// (parallels_read_format_extension); a read-write one would ignore it.
Task<Status> check_extension(io::HostFile& file, const parallels::Header& h, const std::string& path) {
  if (h.ext_off == 0) co_return Status::ok();
  if (h.ext_off > (UINT64_MAX - h.cluster_size()) >> 9)
    co_return Status::errorf(EINVAL, "{}: Parallels format extension offset {:#x} is out of range", path, h.ext_off);
  const uint64_t at = h.ext_off * kSector;
  std::vector<std::byte> ext(std::min(h.cluster_size(), parallels::kMaxExtRead));
  QCOWFS_CO_TRY(co_await read_padded(file, at, ext, "Parallels format extension"));
  if (ext.size() < parallels::kExtHeaderSize || load_le64(ext.data()) != parallels::kExtMagic)
    co_return parallels::check_extension(ext, h.cluster_size(), h.nb_sectors, path);  // names the bad magic
  if (h.cluster_size() > parallels::kMaxExtCluster)
    co_return Status::errorf(EFBIG, "{}: Parallels format extension cluster of {} bytes is past qcowfs's limit of {}",
                             path, h.cluster_size(), parallels::kMaxExtCluster);
  QCOWFS_CO_TRY(co_await check_extension_md5(file, at, h.cluster_size(), ext, path));
  co_return parallels::check_extension(ext, h.cluster_size(), h.nb_sectors, path);
}

// Read-write opens: refused where QEMU refuses them (not closed cleanly),
// where a write would spoil something (the format extension's bitmaps), or
// where a cluster write could land on the header, the BAT or another cluster.
Status check_writable(const parallels::Header& h, const parallels::ClusterMap& map, uint64_t clusters,
                      const std::string& path) {
  auto refuse = [&](std::string why) {
    return Status::errorf(EROFS, "{}: {}; qcowfs opens this Parallels image read-only (mount it with ro)", path, why);
  };
  if (h.inuse)
    return refuse(
        "parallels: Image was not closed correctly; cannot be opened read/write (qemu-img check -r all "
        "repairs it)");
  if (h.ext_off != 0) return refuse("its format extension (dirty bitmaps) would go stale");
  if (map.entries() < clusters) return refuse("its BAT does not cover the disk");
  const uint64_t meta_end = parallels::ParallelsWriter::meta_end(clusters);
  const uint64_t unit = h.off_multiplier * kSector;
  std::vector<uint64_t> hosts;
  for (uint64_t c = 0; c < map.entries(); ++c) {
    const uint32_t e = map.entry(c);
    if (e == 0) continue;
    if (uint64_t{e} * unit < meta_end)
      return refuse(fmt::format("BAT entry {} names host offset {:#x}, on the header and BAT", c, uint64_t{e} * unit));
    hosts.push_back(uint64_t{e} * unit);
  }
  std::sort(hosts.begin(), hosts.end());
  for (size_t i = 1; i < hosts.size(); ++i)
    if (hosts[i] - hosts[i - 1] < h.cluster_size())
      return refuse(fmt::format("two BAT entries name overlapping clusters (host offset {:#x})", hosts[i]));
  return Status::ok();
}

// The writer of a read-write open: `inuse` set on disk before any request.
Task<Result<std::unique_ptr<ExtentWriter>>> make_writer(io::HostFile& file, const std::string& path,
                                                        const parallels::Header& h, parallels::ClusterMap& map) {
  const uint64_t clusters = (h.nb_sectors * kSector + h.cluster_size() - 1) / h.cluster_size();
  QCOWFS_CO_TRY(check_writable(h, map, clusters, path));
  io::AlignedBuffer meta(static_cast<size_t>(parallels::ParallelsWriter::meta_end(clusters)), file.mem_align(), true);
  QCOWFS_CO_TRY(co_await read_padded(file, 0, meta.span(), "Parallels header and BAT"));
  auto w = std::make_unique<parallels::ParallelsWriter>(file, path, h, map, std::move(meta));
  Status st = co_await w->mark_in_use();
  if (!st) co_return st.with_context(path + ": marking the Parallels image in use");
  co_return std::unique_ptr<ExtentWriter>(std::move(w));
}

}  // namespace

Task<Result<std::unique_ptr<BlockDriver>>> open_parallels(std::unique_ptr<io::HostFile> file, std::string path,
                                                          ImageOptions opts) {
  if (!opts.snapshot.empty()) co_return Status::errorf(EINVAL, "{}: Parallels images have no snapshots", path);
  std::array<std::byte, parallels::kHeaderSize> b;
  QCOWFS_CO_TRY(co_await read_padded(*file, 0, b, "Parallels header"));
  auto h = parallels::parse_header(b, path);
  if (!h) co_return h.status();
  auto bat = co_await read_bat(*file, *h, path);
  if (!bat) co_return bat.status();
  // A read-write open ignores the extension, as QEMU's does, and is refused
  // for having one (check_writable).
  if (!opts.file.writable) QCOWFS_CO_TRY(co_await check_extension(*file, *h, path));
  ExtentImage img;
  img.format = "parallels";
  img.path = path;
  img.size = h->nb_sectors * kSector;
  auto map =
      std::make_unique<parallels::ClusterMap>(file.get(), path, h->cluster_size(), h->off_multiplier, std::move(*bat));
  if (opts.file.writable) QCOWFS_CO_TRY(take_writer(img, co_await make_writer(*file, path, *h, *map)));
  co_return one_file_driver(std::move(img), std::move(map), std::move(file));
}

}  // namespace qcowfs::image
