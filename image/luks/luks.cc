#include "image/luks/luks.h"

#include <charconv>
#include <cstring>
#include <vector>

#include "image/shrink.h"
#include "io/align.h"
#include "io/buffer.h"
#include "io/log.h"

namespace qcowfs::image {

LuksDriver::LuksDriver(std::unique_ptr<io::HostFile> file, crypto::UnlockedLuks luks)
    : file_(std::move(file)),
      luks_(std::move(luks)),
      crypt_(*file_, luks_.cipher, luks_.info.payload_offset),
      payload_(luks_.info.payload_offset) {}

uint64_t LuksDriver::size() const {
  const uint64_t s = file_->size();
  return s > payload_ ? s - payload_ : 0;
}

Task<Status> LuksDriver::read(uint64_t off, std::span<std::byte> buf) {
  auto n = co_await crypt_.read(payload_ + off, buf);
  if (!n) co_return n.status();
  if (*n < buf.size()) std::memset(buf.data() + *n, 0, buf.size() - *n);  // a file cut inside a sector
  co_return Status::ok();
}

Task<Status> LuksDriver::write(uint64_t off, std::span<const std::byte> buf) {
  if (read_only()) co_return Status::error(EROFS, "image is read-only");
  co_return co_await crypt_.write(payload_ + off, buf);
}

// Freeing host space would make the range decrypt to noise, which a discard
// allows but nothing gains from: dropped, as QEMU's crypto driver does.
Task<Status> LuksDriver::discard(uint64_t, uint64_t) {
  if (read_only()) co_return Status::error(EROFS, "image is read-only");
  co_return Status::ok();
}

Task<Status> LuksDriver::write_zeroes(uint64_t off, uint64_t len, bool) {
  if (read_only()) co_return Status::error(EROFS, "image is read-only");
  co_return co_await crypt_.write_zeroes(payload_ + off, len);
}

Task<Status> LuksDriver::truncate(uint64_t new_size) {
  if (read_only()) co_return Status::error(EROFS, "image is read-only");
  if (file_->is_block_device()) co_return Status::error(EINVAL, "a LUKS device has a fixed size");
  const uint64_t old = size();
  if (new_size % luks_.spec.sector_size != 0)
    co_return Status::errorf(EINVAL, "a LUKS image grows in whole {}-byte sectors", luks_.spec.sector_size);
  if (new_size < old) {
    QCOWFS_CO_TRY(co_await check_shrink(*this, new_size));
    co_return co_await file_->truncate(payload_ + new_size);
  }
  // The new sectors read as zeros, as a grown raw image does.
  if (new_size > old) QCOWFS_CO_TRY(co_await crypt_.write_zeroes(payload_ + old, new_size - old));
  co_return Status::ok();
}

Task<Result<BlockStatus>> LuksDriver::block_status(uint64_t, uint64_t len) {
  BlockStatus st;
  st.length = len;
  st.data = true;
  st.present = true;
  co_return st;
}

Task<Status> LuksDriver::close() {
  if (read_only()) co_return Status::ok();
  co_return co_await file_->flush();
}

ImageDetails LuksDriver::details() const {
  ImageDetails d;
  d.encrypted = true;
  d.specific = crypto::luks_details(luks_.info, false);
  return d;
}

Task<Result<std::unique_ptr<BlockDriver>>> open_luks(std::unique_ptr<io::HostFile> file, std::string path,
                                                     ImageOptions opts) {
  if (!opts.snapshot.empty()) co_return Status::errorf(EINVAL, "{}: LUKS images have no snapshots", path);
  auto keys = crypto::key_provider_or_terminal(opts.keys);
  auto luks = co_await crypto::unlock_luks_file(*file, *keys, path);
  if (!luks) co_return luks.status();
  if (luks->info.payload_offset > file->size())
    co_return Status::errorf(EINVAL, "{}: the LUKS payload offset {} is past the end of the file ({} bytes)", path,
                             luks->info.payload_offset, file->size());
  std::unique_ptr<BlockDriver> d = std::make_unique<LuksDriver>(std::move(file), std::move(*luks));
  co_return d;
}

// ---- creating LUKS1 images ----

Task<Status> create_luks(io::HostFile& file, const crypto::LuksFormatted& formatted, uint64_t size) {
  io::AlignedBuffer header(formatted.header.size(), file.mem_align());
  std::copy(formatted.header.begin(), formatted.header.end(), header.data());
  QCOWFS_CO_TRY(co_await file.write(0, header.span()));
  QCOWFS_CO_TRY(co_await file.truncate(formatted.payload_offset + align_up(size, crypto::kCryptSectorSize)));
  co_return co_await file.flush();
}

}  // namespace qcowfs::image
