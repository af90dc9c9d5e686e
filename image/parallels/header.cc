#include "image/parallels/header.h"

#include <cstring>

#include "image/endian.h"

namespace qcowfs::image::parallels {
namespace {

bool has_magic(std::span<const std::byte> b, std::string_view magic) {
  return std::memcmp(b.data() + kMagicOff, magic.data(), magic.size()) == 0;
}

// A dirty bitmap's feature data (parallels_load_bitmap): its size must be the
// disk's and its L1 table must fit in the data.
Status check_bitmap_feature(std::span<const std::byte> ext, uint64_t pos, uint64_t data_size, uint64_t nb_sectors,
                            const std::string& path) {
  if (data_size < kBitmapFeatureSize || pos + kBitmapFeatureSize > ext.size())
    return Status::errorf(EINVAL, "{}: Parallels dirty bitmap feature is too short", path);
  const uint64_t sectors = load_le64(&ext[pos]);
  const uint64_t l1_size = load_le32(&ext[pos + kBitmapL1SizeOff]);
  if (sectors != nb_sectors)
    return Status::errorf(EINVAL, "{}: Parallels bitmap size (in sectors) {} differs from disk size in sectors {}",
                          path, sectors, nb_sectors);
  if (l1_size * 8 > data_size - kBitmapFeatureSize)
    return Status::errorf(EINVAL, "{}: Parallels bitmaps feature corrupted: l1 table exceeds data_size", path);
  return Status::ok();
}

}  // namespace

Result<Header> parse_header(std::span<const std::byte, kHeaderSize> b, const std::string& path) {
  Header h;
  h.nb_sectors = load_le64(&b[kNbSectorsOff]);
  h.tracks = load_le32(&b[kTracksOff]);
  if (load_le32(&b[kVersionOff]) != kVersion)
    return Status::errorf(EINVAL, "{}: image not in Parallels format (version {}, not 2)", path,
                          load_le32(&b[kVersionOff]));
  if (has_magic(b, kMagicOld)) {
    h.off_multiplier = 1;
    h.nb_sectors &= 0xffffffff;
  } else if (has_magic(b, kMagicExt)) {
    h.off_multiplier = h.tracks;
  } else {
    return Status::errorf(EINVAL, "{}: image not in Parallels format (bad magic)", path);
  }
  if (h.tracks == 0) return Status::errorf(EINVAL, "{}: invalid Parallels image: zero sectors per track", path);
  if (h.tracks > kMaxTracks)
    return Status::errorf(EFBIG, "{}: invalid Parallels image: too big cluster ({} sectors)", path, h.tracks);
  h.bat_entries = load_le32(&b[kBatEntriesOff]);
  if (h.bat_entries > kMaxBatEntries)
    return Status::errorf(EFBIG, "{}: Parallels catalog too large ({} entries)", path, h.bat_entries);
  const uint64_t header_read = (kBatOff + uint64_t{h.bat_entries} * 4 + kHeaderReadAlign - 1) & ~(kHeaderReadAlign - 1);
  if (header_read > kMaxHeaderRead)
    return Status::errorf(EIO, "{}: Parallels header and BAT of {} entries are too large to read ({} bytes)", path,
                          h.bat_entries, header_read);
  if (h.nb_sectors > (uint64_t{INT64_MAX} >> 9))
    return Status::errorf(EFBIG, "{}: Parallels disk size of {} sectors is too large", path, h.nb_sectors);
  h.inuse = load_le32(&b[kInuseOff]) == kInuseMagic;
  h.data_off = load_le32(&b[kDataOffOff]);
  h.ext_off = load_le64(&b[kExtOffOff]);
  return h;
}

// The walk of parallels_parse_format_extension(): features follow one another
// until the end magic; `remaining` shrinks by the headers only, as QEMU's does.
// The MD5 is checked by the opener (parallels.cc); qcowfs does not read the
// bitmaps' data clusters (they do not change what the disk reads as).
Status check_extension(std::span<const std::byte> ext, uint64_t cluster_size, uint64_t nb_sectors,
                       const std::string& path) {
  if (ext.size() < kExtHeaderSize || load_le64(ext.data()) != kExtMagic)
    return Status::errorf(EINVAL, "{}: wrong Parallels format extension magic {:#x}, expected {:#x}", path,
                          ext.size() >= 8 ? load_le64(ext.data()) : 0, kExtMagic);
  uint64_t pos = kExtHeaderSize;
  uint64_t remaining = cluster_size - kExtHeaderSize;
  while (true) {
    if (remaining < kFeatureHeaderSize)
      return Status::errorf(EINVAL, "{}: Parallels format extension: no room for a feature header", path);
    if (pos + kFeatureHeaderSize > ext.size())
      return Status::errorf(EINVAL, "{}: Parallels format extension features run past the {} bytes qcowfs reads",
                            path, ext.size());
    const uint64_t magic = load_le64(&ext[pos]);
    const uint64_t flags = load_le64(&ext[pos + 8]);
    const uint64_t data_size = load_le32(&ext[pos + kFeatureDataSizeOff]);
    pos += kFeatureHeaderSize;
    remaining -= kFeatureHeaderSize;
    if (flags != 0) return Status::errorf(EINVAL, "{}: Parallels extension feature flags are unsupported", path);
    if (data_size > remaining)
      return Status::errorf(EINVAL, "{}: Parallels format extension feature data out of cluster", path);
    if (magic == kFeatureEnd) return Status::ok();
    if (magic != kFeatureDirtyBitmap)
      return Status::errorf(EINVAL, "{}: unknown Parallels format extension feature {:#x}", path, magic);
    QCOWFS_TRY(check_bitmap_feature(ext, pos, data_size, nb_sectors, path));
    pos = (pos + data_size + 7) & ~uint64_t{7};
  }
}

}  // namespace qcowfs::image::parallels
