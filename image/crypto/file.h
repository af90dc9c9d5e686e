// CryptFile: a HostFile that encrypts on the way to another HostFile and
// decrypts on the way back, with the same offsets. The formats put it where
// their data lives: qcow2 with LUKS reads and writes data clusters through it
// (IVs from the host offset), a raw LUKS image its payload (IVs from the
// offset in the payload: iv_origin is the payload offset). Metadata never
// goes through it.
//
// Reads decrypt in place in the caller's buffer when the range is whole
// cipher sectors; writes encrypt into a buffer of their own (the caller's data
// is never changed, and nothing decrypted reaches the host file). Ranges that
// cut a sector are read-modify-written under an exclusive range lock, whole
// sectors lock theirs shared, so no two writes mix their halves of a sector.
// write_zeroes() writes encrypted zeros (zeros on the host would decrypt to
// noise); discard() passes through: discarded ranges read as anything.
// Large transfers en/decrypt on the worker pool (encrypt_async).
//
// Thread-safety: as HostFile. The inner file and the cipher must outlive it.
#pragma once

#include <memory>

#include "image/crypto/cipher.h"
#include "io/host_file.h"
#include "io/range_lock.h"

namespace qcowfs::image::crypto {

class CryptFile final : public io::HostFile {
 public:
  // Byte `off` of the file is byte `off` of inner, its IV number
  // (off - iv_origin) / sector size. Offsets below iv_origin are refused.
  CryptFile(io::HostFile& inner, std::shared_ptr<const SectorCipher> cipher, uint64_t iv_origin = 0);

  Task<Result<size_t>> read(uint64_t off, std::span<std::byte> buf) override;
  Task<Result<size_t>> readv(uint64_t off, std::span<const iovec> iov) override;
  Task<Status> write(uint64_t off, std::span<const std::byte> buf) override;
  Task<Status> writev(uint64_t off, std::span<const iovec> iov) override;
  Task<Status> flush() override { return inner_.flush(); }
  Task<Status> discard(uint64_t off, uint64_t len) override { return inner_.discard(off, len); }
  Task<Status> write_zeroes(uint64_t off, uint64_t len) override;
  Task<Status> truncate(uint64_t size) override { return inner_.truncate(size); }
  Task<Result<uint64_t>> seek_data(uint64_t off) override { return inner_.seek_data(off); }
  Task<Result<uint64_t>> seek_hole(uint64_t off) override { return inner_.seek_hole(off); }
  uint64_t size() const override { return inner_.size(); }
  uint64_t allocated_bytes() const override { return inner_.allocated_bytes(); }
  size_t mem_align() const override { return inner_.mem_align(); }
  size_t offset_align() const override;
  bool is_block_device() const override { return inner_.is_block_device(); }
  bool writable() const override { return inner_.writable(); }
  io::CacheMode cache_mode() const override { return inner_.cache_mode(); }
  const std::string& path() const override { return inner_.path(); }

  io::HostFile& inner() { return inner_; }
  const SectorCipher& cipher() const { return *cipher_; }

 private:
  Status check_range(uint64_t off, uint64_t len) const;
  Task<Result<size_t>> read_sectors(uint64_t start, std::span<std::byte> dst);
  Task<Status> write_sectors(uint64_t start, std::span<std::byte> plain);

  io::HostFile& inner_;
  std::shared_ptr<const SectorCipher> cipher_;
  uint64_t iv_origin_;
  uint32_t sector_;
  io::RangeLock locks_;
};

}  // namespace qcowfs::image::crypto
