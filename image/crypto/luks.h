// LUKS1 and LUKS2 headers and key slots. parse_luks_header is a pure parser of
// the binary header (LUKS1: the whole 592-byte phdr with QEMU's consistency
// checks; LUKS2: the binary header only, its JSON is left to libcryptsetup)
// that refuses hostile values before anything is derived or allocated from
// them. LuksVolume is one header opened by libcryptsetup (crypt_device*, freed
// in the destructor): its view of ciphers and key slots, and unlocking the
// volume key with a passphrase into a SecretBuffer. format_luks1 makes a new
// LUKS1 header as qemu-img create -f luks does.
//
// libcryptsetup is set up once per process before the first crypt_init: its
// log goes to io/log.h at debug level and its metadata locking (/run/cryptsetup)
// is off, so everything here works unprivileged. libcryptsetup never sees the
// image itself: every header it reads is a copy in a memfd that it opens as
// /proc/self/fd/N (it accepts that: no temporary file is ever written). For
// a LUKS image (open_file) the copy is read through io::HostFile, so the image
// may be anything a HostFile reads; libcryptsetup's crypt_init wants a path,
// which the memfd gives it.
//
// Thread-safety: parse_luks_header and format_luks1 are pure / independent and
// may run on any thread. A LuksVolume's const methods may be called from any
// thread but not concurrently with each other (libcryptsetup's handle is not
// thread-safe; callers unlock once at open).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "image/crypto/luks1.h"
#include "image/crypto/secret.h"
#include "io/host_file.h"
#include "io/status.h"
#include "io/task.h"

struct crypt_device;

namespace qcowfs::image::crypto {

struct LuksFormatParams;
struct LuksFormatted;

// "LUKS\xba\xbe": the first six bytes of LUKS1 and LUKS2 headers.
inline constexpr std::array<std::byte, 6> kLuksMagic = {std::byte{'L'}, std::byte{'U'},  std::byte{'K'},
                                                        std::byte{'S'}, std::byte{0xba}, std::byte{0xbe}};
inline constexpr int kLuksVersion1 = 1;
inline constexpr int kLuksVersion2 = 2;

// LUKS1's on-disk layout and limits are in crypto/luks1.h (one parser for both
// this header's view and the key-slot fallback).
inline constexpr uint32_t kLuks1Stripes = 4000;  // what cryptsetup and QEMU write (format_luks1 too)
// LUKS2 binary header (the first 4096 bytes of each of the two header copies).
inline constexpr size_t kLuks2BinaryHeaderBytes = 4096;
inline constexpr uint64_t kLuks2MinHeaderBytes = 16 << 10;  // hdr_size: 16 KiB .. 4 MiB, a power of two
inline constexpr uint64_t kLuks2MaxHeaderBytes = 4 << 20;
// The bytes parse_luks_header wants to see: the LUKS2 binary header (a LUKS1 one is shorter).
inline constexpr size_t kLuksProbeBytes = kLuks2BinaryHeaderBytes;

// Refusal limits, checked before any key derivation (EINVAL "... exceeds the limit of ...").
// PBKDF2: cryptsetup's 2 s benchmark gives about 2-4 million SHA-256 iterations on a fast CPU today;
// 2^26 is 16-30 times that (some 30 s of derivation at worst), far beyond any header a real tool made.
inline constexpr uint32_t kMaxArgon2MemoryKiB = 4u << 20;  // 4 GiB, cryptsetup's own maximum
inline constexpr uint32_t kMaxArgon2Iterations = 1000;
inline constexpr uint32_t kMaxArgon2Parallel = 16;
// The LUKS area / header plus key material we read or hand to libcryptsetup.
inline constexpr uint64_t kMaxLuksHeaderBytes = 64u << 20;

struct LuksKeySlotInfo {
  unsigned index = 0;
  bool active = false;
  uint64_t key_offset = 0;  // bytes from the header start
  uint64_t key_length = 0;  // bytes of key material (area length)
  uint32_t stripes = 0;     // anti-forensic stripes (LUKS1: from the header; LUKS2: af.stripes)
  std::string pbkdf;        // "pbkdf2", "argon2i", "argon2id"
  std::string hash;         // pbkdf2 hash
  uint32_t iterations = 0;  // pbkdf2 iterations or argon2 time cost
  uint32_t memory_kib = 0;  // argon2
  uint32_t parallel = 0;    // argon2
};

struct LuksInfo {
  int version = 1;              // 1 or 2
  std::string cipher_name;      // "aes", "serpent", "twofish", "cast5"
  std::string cipher_mode;      // as stored: "xts-plain64", "cbc-essiv:sha256", "ecb", "ctr-plain64"
  size_t key_bytes = 0;         // volume (master) key length
  std::string hash;             // LUKS1 hash-spec; LUKS2 the digest's hash
  uint64_t payload_offset = 0;  // bytes from the header start to the encrypted data
  uint32_t sector_size = 512;   // LUKS1 512; LUKS2 the segment's sector_size (512..4096)
  uint64_t metadata_bytes = 0;  // header + every key slot's material: where the payload may start at the earliest
  std::string uuid;
  std::string label;                   // LUKS2 only
  uint32_t master_key_iterations = 0;  // LUKS1 mk-digest iterations (qemu-img info shows them); 0 for LUKS2
  std::vector<LuksKeySlotInfo> slots;  // LUKS1: all 8 in order; LUKS2: those present
};

// Parses the header at the start of head (kLuksProbeBytes are enough; fewer when the file is shorter).
// LUKS1: every check of QEMU's qcrypto_block_luks_check_header (stripes, active flags, key material
// overlapping the header, the payload or another slot), NUL-terminated strings, a cipher, mode and hash
// QEMU knows with a key length that fits the cipher, and the iteration limits above. LUKS2: the binary
// header (magic, version, hdr_size, checksum algorithm, uuid, label) with bounds checks only; cipher,
// sector size and slots stay empty (LuksVolume fills them from the JSON through libcryptsetup).
// available: bytes of the file or area that holds the header (key material must fit in it).
// Errors name what and the offending field: EINVAL for a damaged or hostile header ("not a LUKS header"
// when the magic is wrong), ENOTSUP for a version, cipher, mode, IV generator or hash QEMU cannot use.
// Limits on key slots (check_luks_slot_limits) are left to unlock, so one bad slot does not hide the others;
// the master key digest's iterations (derived on every unlock) are checked here.
Result<LuksInfo> parse_luks_header(std::span<const std::byte> head, uint64_t available, std::string_view what);

// Checks one key slot's key derivation parameters against the limits above (EINVAL naming the slot,
// the value and the limit; an unknown pbkdf is EINVAL too).
Status check_luks_slot_limits(const LuksKeySlotInfo& slot, std::string_view what);

class LuksVolume {
 public:
  // A raw LUKS image, read through file: the header is read and parsed (parse_luks_header, the
  // file's size as available) before libcryptsetup sees it; then libcryptsetup loads a copy in a
  // memfd as large as the file (sparse) holding the header (LUKS1: its first 4 KiB; LUKS2: both
  // binary headers and JSON areas) and, once the header names them, every active key slot's
  // material (EFBIG past kMaxLuksHeaderBytes in all). Nothing else of the file is read.
  static Task<Result<LuksVolume>> open_file(io::HostFile& file, std::string_view what);
  // A header held in memory: the LUKS area inside a qcow2 image (its offsets are relative to the area;
  // the payload offset is meaningless there). Copied into a memfd that libcryptsetup opens as
  // /proc/self/fd/N, a detached header (the memfd lives as long as the volume). EFBIG past
  // kMaxLuksHeaderBytes.
  static Result<LuksVolume> open_bytes(std::span<const std::byte> area, std::string_view what);

  LuksVolume(LuksVolume&&) noexcept;
  LuksVolume& operator=(LuksVolume&&) noexcept;
  LuksVolume(const LuksVolume&) = delete;
  LuksVolume& operator=(const LuksVolume&) = delete;
  ~LuksVolume();

  // libcryptsetup's view (cipher, mode, volume key size, data offset, sector size, uuid, key slot status,
  // pbkdf and area) over our parser's fields for the rest (LUKS1 hash, mk-digest iterations, stripes).
  const LuksInfo& info() const { return info_; }

  // The volume key. Every active slot's pbkdf is checked against the limits first: a slot over a limit
  // is not tried (if every active slot is over, its EINVAL is returned and nothing is derived).
  // Wrong passphrase: EACCES "wrong passphrase for <what> (no key slot accepts it)". The key is written
  // by libcryptsetup straight into the returned SecretBuffer.
  Result<SecretBuffer> unlock(std::span<const std::byte> passphrase) const;

  // len bytes at off of the header copy libcryptsetup reads (zeros past what was copied): key
  // material for the libgcrypt key-slot path (crypto/luks1.h). EINVAL for a volume of format_luks1.
  Result<std::vector<std::byte>> header_bytes(uint64_t off, size_t len) const;

 private:
  struct CryptFree {
    void operator()(crypt_device* cd) const;
  };
  using Device = std::unique_ptr<crypt_device, CryptFree>;
  class Memfd;

  LuksVolume(Device cd, std::shared_ptr<Memfd> memfd, LuksInfo info, std::string what);
  static Result<LuksVolume> load(std::shared_ptr<Memfd> memfd, LuksInfo parsed, std::string_view what);
  static Task<Status> copy_in(io::HostFile& file, const Memfd& memfd, uint64_t off, uint64_t len,
                              std::string_view what);
  friend Result<LuksFormatted> format_luks1(const LuksFormatParams&, std::span<const std::byte>);

  Device cd_;
  std::shared_ptr<Memfd> memfd_;  // the header copy libcryptsetup reads
  LuksInfo info_;
  std::string what_;
};

// Creates a LUKS1 header with key slot 0 holding a new random volume key under the passphrase
// (libcryptsetup: crypt_format(CRYPT_LUKS1) on a memfd, crypt_set_pbkdf_type with iter-time, then
// crypt_keyslot_add_by_volume_key), as qemu-img create -f luks / -o encrypt.format=luks does.
struct LuksFormatParams {
  std::string cipher_name = "aes";
  std::string cipher_mode = "xts-plain64";
  size_t key_bytes = 64;
  std::string hash = "sha256";    // pbkdf2 hash (and QEMU's "hash-alg")
  uint32_t iter_time_ms = 2000;   // QEMU's iter-time default
  uint64_t payload_align = 4096;  // the payload offset is rounded up to this (bytes, multiple of 512)
};
struct LuksFormatted {
  std::vector<std::byte> header;  // payload_offset bytes: the header and key material (no secrets in clear)
  SecretBuffer volume_key;
  uint64_t payload_offset = 0;
};
Result<LuksFormatted> format_luks1(const LuksFormatParams& params, std::span<const std::byte> passphrase);

}  // namespace qcowfs::image::crypto
