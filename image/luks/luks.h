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
#include "image/crypto/crypto_file.h"
#include "image/crypto/crypto_luks.h"
#include "image/crypto/crypto_unlock.h"

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

}  // namespace qcowfs::image

namespace qcowfs::image {

// ---- creating LUKS1 images (qemu-img create -f luks, and qcow2's -o encrypt.*) ----

// The LUKS options of qemu-img create, by QEMU's names and with its defaults
// (block/crypto.c): cipher-alg, cipher-mode, ivgen-alg, ivgen-hash-alg,
// hash-alg, iter-time; key-file replaces QEMU's key-secret (the passphrase is
// the file's whole content, "-" standard input; none: the terminal prompt).
struct LuksCreateOptions {
  std::string cipher_alg = "aes-256";
  std::string cipher_mode = "xts";
  std::string ivgen_alg = "plain64";
  std::string ivgen_hash_alg;  // empty: not given (essiv then takes sha256, as QEMU)
  std::string hash_alg = "sha256";
  uint32_t iter_time_ms = 2000;
  std::string key_file;  // empty: prompt on the terminal
};

// QEMU's LUKS payload alignment (crypto/block-luks.c: key material and the
// payload at 4096-byte boundaries), for raw LUKS and the LUKS area of qcow2.
inline constexpr uint64_t kLuksCreateAlign = 4096;

// Applies one option by its unprefixed name ("cipher-alg", "key-file", ...);
// EINVAL for an unknown name or value (the message names both, the name after
// prefix: "encrypt." for qcow2's options).
Status apply_luks_create_option(LuksCreateOptions& o, std::string_view key, std::string_view value,
                                std::string_view prefix = "");
// Whether key is one of the names apply_luks_create_option takes.
bool is_luks_create_option(std::string_view key);

// The header parameters o describes (cipher name, LUKS mode string such as
// "cbc-essiv:sha256", key length), payload aligned to kLuksCreateAlign.
Result<crypto::LuksFormatParams> luks_format_params(const LuksCreateOptions& o);

// Makes a raw LUKS1 image in file (empty, writable) as qemu-img create -f luks:
// the header and key material (formatted.header), then a sparse payload of
// size bytes (rounded up to 512), so the file is payload_offset + size long.
Task<Status> create_luks(io::HostFile& file, const crypto::LuksFormatted& formatted, uint64_t size);

}  // namespace qcowfs::image
