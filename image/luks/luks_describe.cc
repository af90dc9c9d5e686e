// `qcowfs info` on a raw LUKS image (image/luks/luks.h): its header alone, as
// qemu-img info reads it without a key.
#include "image/crypto/luks.h"
#include "image/crypto/unlock.h"
#include "image/luks/luks.h"

namespace qcowfs::image {

Task<Result<ImageDescription>> describe_luks(std::unique_ptr<io::HostFile> file, std::string path,
                                             ImageOptions /*opts*/) {
  auto vol = co_await crypto::LuksVolume::open_file(*file, path);
  if (!vol) co_return vol.status();
  const uint64_t payload = vol->info().payload_offset;
  ImageDescription d;
  d.virtual_size = file->size() > payload ? file->size() - payload : 0;
  d.actual_size = file->allocated_bytes();
  d.details.dirty = false;
  d.details.encrypted = true;
  d.details.specific = crypto::luks_details(vol->info(), false);
  co_return d;
}

}  // namespace qcowfs::image
