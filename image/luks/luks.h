// LuksDriver: a raw LUKS image (qemu-img's `-f luks`, cryptsetup's LUKS1 and
// LUKS2 on a file or block device) seen as its decrypted payload: guest byte
// x is payload byte x, at host offset payload_offset + x, encrypted per
// sector with IVs counted from the payload's start (CryptFile). Read-write;
// write_zeroes writes encrypted zeros, discard is dropped (a discarded
// range of a LUKS disk reads as noise, never as zeros), growth writes
// encrypted zeros, shrinking refuses to drop data (image/shrink.h).
// block_status reports every byte as data, as QEMU's crypto driver does.
//
// Thread-safety: as BlockDriver; the size changes only in truncate().
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "image/block_driver.h"
#include "image/create.h"
#include "image/describe.h"
#include "image/crypto/file.h"
#include "image/crypto/luks.h"
#include "image/crypto/unlock.h"
#include "image/crypto/luks_create.h"

namespace qcowfs::image {

class LuksDriver final : public BlockDriver {
 public:
  LuksDriver(std::unique_ptr<io::HostFile> file, crypto::UnlockedLuks luks);

  std::string_view format_name() const override { return "luks"; }
  uint64_t size() const override;
  bool read_only() const override { return !file_->writable(); }
  size_t mem_align() const override { return file_->mem_align(); }

  Task<Status> read(uint64_t off, std::span<std::byte> buf) override;
  Task<Status> write(uint64_t off, std::span<const std::byte> buf) override;
  Task<Status> flush() override { return file_->flush(); }
  Task<Status> discard(uint64_t off, uint64_t len) override;
  Task<Status> write_zeroes(uint64_t off, uint64_t len, bool may_unmap) override;
  Task<Status> truncate(uint64_t new_size) override;
  Task<Result<BlockStatus>> block_status(uint64_t off, uint64_t len) override;
  uint64_t allocated_bytes() const override { return file_->allocated_bytes(); }
  Task<Status> close() override;
  ImageDetails details() const override;

 private:
  std::unique_ptr<io::HostFile> file_;
  crypto::UnlockedLuks luks_;
  crypto::CryptFile crypt_;
  uint64_t payload_;
};

// The registry's entry point (image/format.h).
Task<Result<std::unique_ptr<BlockDriver>>> open_luks(std::unique_ptr<io::HostFile> file, std::string path,
                                                     ImageOptions opts);

// `qcowfs info`, the registry's DescribeFormatFn (image/describe.h): the
// header alone, without the passphrase; the virtual size is the file after
// the payload offset.
Task<Result<ImageDescription>> describe_luks(std::unique_ptr<io::HostFile> file, std::string path,
                                             ImageOptions opts);

}  // namespace qcowfs::image

namespace qcowfs::image {

// ---- creating raw LUKS1 images (qemu-img create -f luks; the options: image/crypto/luks_create.h) ----

// Makes a raw LUKS1 image in file (empty, writable) as qemu-img create -f luks:
// the header and key material (formatted.header), then a sparse payload of
// size bytes (rounded up to 512), so the file is payload_offset + size long.
Task<Status> create_luks(io::HostFile& file, const crypto::LuksFormatted& formatted, uint64_t size);

// `qcowfs create -f luks`, the registry's PrepareCreateFn (image/create.h):
// size= and the LUKS options by their unprefixed names (key-file,
// cipher-alg, ..., iter-time); no backing file. The passphrase is asked in
// Creator::ask_secrets(), once the image is locked.
Result<std::unique_ptr<Creator>> prepare_luks_create(const CreateRequest& request);

}  // namespace qcowfs::image
