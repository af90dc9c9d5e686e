// open_parallels(): QEMU 7.2's parallels_open() (block/parallels.c) for a
// read-only open over our HostFile: header checks, the BAT, the format
// extension's checks, then an ExtentDriver over a ClusterMap.
#include "image/parallels/parallels.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "image/endian.h"
#include "image/extent_driver.h"
#include "image/host_read.h"
#include "image/parallels/format.h"
#include "image/parallels/header.h"
#include "image/parallels/map.h"
#include "image/parallels/md5.h"

namespace qcowfs::image {
namespace {

using parallels::kSector;

// The core's read_padded() (zeros past the end of the file, as QEMU's
// bdrv_pread), with the structure named in a failure.
Task<Status> read_padded(io::HostFile& file, uint64_t off, std::span<std::byte> buf, std::string_view what,
                         const std::string& path) {
  Status st = co_await image::read_padded(file, off, buf);
  co_return st.with_context(fmt::format("{}: reading the Parallels {}", path, what));
}

// The BAT entries that lie inside the file, in host order.
Task<Result<std::vector<uint32_t>>> read_bat(io::HostFile& file, const parallels::Header& h,
                                             const std::string& path) {
  const uint64_t fsize = file.size();
  const uint64_t in_file = fsize > parallels::kBatOff ? (fsize - parallels::kBatOff) / 4 : 0;
  const uint64_t n = std::min<uint64_t>(h.bat_entries, in_file);
  if (n > parallels::kMaxBatInMemory)
    co_return Status::errorf(EFBIG, "{}: Parallels BAT of {} entries is past qcowfs's limit of {} ({} MiB)", path,
                             n, parallels::kMaxBatInMemory, parallels::kMaxBatInMemory * 4 >> 20);
  std::vector<uint32_t> bat(n);
  std::span<std::byte> raw(reinterpret_cast<std::byte*>(bat.data()), n * 4);
  QCOWFS_CO_TRY(co_await read_padded(file, parallels::kBatOff, raw, "BAT", path));
  for (uint32_t& e : bat) e = load_le32(reinterpret_cast<const std::byte*>(&e));
  co_return bat;
}

// The MD5 of the extension cluster after its header, read in chunks (zeros
// past the end of the file), against the one the header records.
Task<Status> check_extension_md5(io::HostFile& file, uint64_t at, uint64_t cluster_size,
                                 std::span<const std::byte> first, const std::string& path) {
  parallels::Md5 md5;
  std::vector<std::byte> chunk(parallels::kMaxExtRead);
  for (uint64_t off = parallels::kExtHeaderSize; off < cluster_size;) {
    const uint64_t n = std::min<uint64_t>(chunk.size(), cluster_size - off);
    std::span<std::byte> part(chunk.data(), n);
    QCOWFS_CO_TRY(co_await read_padded(file, at + off, part, "format extension", path));
    md5.update(part);
    off += n;
  }
  if (std::memcmp(md5.digest().data(), first.data() + 8, 16) != 0)
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
  QCOWFS_CO_TRY(co_await read_padded(file, at, ext, "format extension", path));
  if (ext.size() < parallels::kExtHeaderSize || load_le64(ext.data()) != parallels::kExtMagic)
    co_return parallels::check_extension(ext, h.cluster_size(), h.nb_sectors, path);  // names the bad magic
  if (h.cluster_size() > parallels::kMaxExtCluster)
    co_return Status::errorf(EFBIG, "{}: Parallels format extension cluster of {} bytes is past qcowfs's limit of {}",
                             path, h.cluster_size(), parallels::kMaxExtCluster);
  QCOWFS_CO_TRY(co_await check_extension_md5(file, at, h.cluster_size(), ext, path));
  co_return parallels::check_extension(ext, h.cluster_size(), h.nb_sectors, path);
}

}  // namespace

Task<Result<std::unique_ptr<BlockDriver>>> open_parallels(std::unique_ptr<io::HostFile> file, std::string path,
                                                          ImageOptions opts) {
  QCOWFS_CO_TRY(refuse_writable_open("Parallels", path, opts));
  if (!opts.snapshot.empty()) co_return Status::errorf(EINVAL, "{}: Parallels images have no snapshots", path);
  std::array<std::byte, parallels::kHeaderSize> b;
  QCOWFS_CO_TRY(co_await read_padded(*file, 0, b, "header", path));
  auto h = parallels::parse_header(b, path);
  if (!h) co_return h.status();
  auto bat = co_await read_bat(*file, *h, path);
  if (!bat) co_return bat.status();
  QCOWFS_CO_TRY(co_await check_extension(*file, *h, path));
  ExtentImage img;
  img.format = "parallels";
  img.path = path;
  img.size = h->nb_sectors * kSector;
  img.map = std::make_unique<parallels::ClusterMap>(file.get(), path, h->cluster_size(), h->off_multiplier,
                                                    std::move(*bat));
  img.files.push_back(std::move(file));
  std::unique_ptr<BlockDriver> d = std::make_unique<ExtentDriver>(std::move(img));
  co_return d;
}

}  // namespace qcowfs::image
