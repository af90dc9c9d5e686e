// SectorCipher: the per-sector data cipher of an encrypted image, over
// libgcrypt (AES with AES-NI, Serpent, Twofish, CAST5 in ECB, CBC, XTS and CTR
// mode; Twofish-192, which libgcrypt lacks, over nettle, the library QEMU
// itself uses), with QEMU's and dm-crypt's IV generators (plain, plain64,
// essiv).
// Data is en/decrypted in place, one sector at a time; the byte offset handed
// in feeds the IV (sector number = offset / sector size): the caller decides
// which offset that is (QEMU: the host offset for LUKS in qcow2, the guest
// offset for legacy qcow2 AES, the payload offset for raw LUKS).
//
// CipherSpec names a cipher the way QEMU's options do (cipher-alg aes-256,
// cipher-mode xts, ivgen-alg plain64, ivgen-hash-alg sha256) and converts
// to and from a LUKS header's cipher name and mode strings ("aes",
// "xts-plain64", "cbc-essiv:sha256").
//
// Thread-safety: a SectorCipher is immutable after create(); encrypt() and
// decrypt() may be called concurrently from any thread (each call borrows a
// libgcrypt handle from an internal pool; handles and the key live in secure
// memory: libgcrypt's locked pool and SecretBuffer).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "image/crypto/secret.h"
#include "io/status.h"
#include "io/task.h"

namespace qcowfs::image::crypto {

enum class CipherAlg : uint8_t {
  aes_128,
  aes_192,
  aes_256,
  serpent_128,
  serpent_192,
  serpent_256,
  twofish_128,
  twofish_192,
  twofish_256,
  cast5_128,
};
enum class CipherMode : uint8_t { ecb, cbc, xts, ctr };
enum class IvGenAlg : uint8_t { plain, plain64, essiv };
enum class HashAlg : uint8_t { md5, sha1, sha224, sha256, sha384, sha512, ripemd160 };

// The smallest and largest sector a cipher works in (LUKS2 allows 512..4096).
inline constexpr uint32_t kCryptSectorSize = 512;
inline constexpr uint32_t kMaxCryptSectorSize = 4096;

struct CipherSpec {
  CipherAlg alg = CipherAlg::aes_256;
  CipherMode mode = CipherMode::xts;
  IvGenAlg ivgen = IvGenAlg::plain64;
  HashAlg ivgen_hash = HashAlg::sha256;  // essiv only
  uint32_t sector_size = kCryptSectorSize;

  // Bytes of key the cipher takes (XTS: two keys).
  size_t key_bytes() const;
  bool operator==(const CipherSpec &) const = default;
};

// QEMU's names: "aes-256", "xts", "plain64", "sha256".
std::string_view name_of(CipherAlg a);
std::string_view name_of(CipherMode m);
std::string_view name_of(IvGenAlg g);
std::string_view name_of(HashAlg h);
std::optional<CipherAlg> parse_cipher_alg(std::string_view s);
std::optional<CipherMode> parse_cipher_mode(std::string_view s);
std::optional<IvGenAlg> parse_ivgen_alg(std::string_view s);
std::optional<HashAlg> parse_hash_alg(std::string_view s);
size_t digest_bytes(HashAlg h);
// libgcrypt's number for the hash (GCRY_MD_*).
int gcrypt_md(HashAlg h);

// Sets libgcrypt up once per process (secure memory for cipher handles, key
// schedules and PBKDF2 state) unless another library already has; every user
// of libgcrypt here calls it first. Thread-safe.
void init_gcrypt();

// The spec a LUKS header describes: cipher name ("aes"), mode string
// ("xts-plain64", "cbc-essiv:sha256", "ecb") and volume key length select
// the algorithm (as QEMU does: aes with a 64-byte XTS key is aes-256).
// EINVAL names what is unknown or unusable.
Result<CipherSpec> spec_from_luks(std::string_view cipher_name, std::string_view cipher_mode, size_t key_bytes,
                                  uint32_t sector_size = kCryptSectorSize);
// The LUKS header strings for a spec: {"aes", "xts-plain64"}.
std::string luks_cipher_name(const CipherSpec &spec);
std::string luks_cipher_mode(const CipherSpec &spec);

// Whether the spec can be used: what QEMU refuses (XTS needs a 16-byte block
// cipher; ESSIV needs a cipher of the family whose key is as long as the
// hash) and what libgcrypt lacks (twofish-192). ENOTSUP/EINVAL with why.
Status check_spec(const CipherSpec &spec);

class SectorCipher {
 public:
  // key: key_bytes() bytes (copied into a SecretBuffer).
  static Result<std::unique_ptr<SectorCipher>> create(const CipherSpec &spec, std::span<const std::byte> key);
  // qcow2's legacy AES (crypt_method 1): AES-128-CBC, plain64 IVs, the key
  // the passphrase's first 16 bytes padded with zeros (QEMU
  // crypto/block-qcow.c).
  static Result<std::unique_ptr<SectorCipher>> legacy_qcow_aes(std::span<const std::byte> passphrase);
  ~SectorCipher();
  SectorCipher(const SectorCipher &) = delete;
  SectorCipher &operator=(const SectorCipher &) = delete;

  const CipherSpec &spec() const { return spec_; }
  uint32_t sector_size() const { return spec_.sector_size; }

  // In place. offset and data.size() are multiples of sector_size() (EINVAL
  // otherwise); sector i of data uses IV number offset / sector_size() + i.
  Status encrypt(uint64_t offset, std::span<std::byte> data) const;
  Status decrypt(uint64_t offset, std::span<std::byte> data) const;

 private:
  struct Handle;  // one libgcrypt cipher handle (and ESSIV's), used by one
                  // thread at a time
  class Lease;

  SectorCipher(const CipherSpec &spec, SecretBuffer key, SecretBuffer essiv_key);
  Result<std::unique_ptr<Handle>> open_handle() const;
  Status crypt(uint64_t offset, std::span<std::byte> data, bool encrypting) const;
  Status set_up_nettle();
  void nettle_sector(std::byte* p, const std::byte* iv, bool encrypting) const;

  CipherSpec spec_;
  SecretBuffer key_;
  SecretBuffer essiv_key_;  // hash of the key (essiv only), cut to the ESSIV
                            // cipher's key length
  int gcry_alg_ = 0;  // 0: the data cipher is nettle's (Twofish-192, which libgcrypt lacks)
  SecretBuffer nettle_keys_;  // nettle's key schedules (data, XTS tweak): immutable, shared by all threads
  int gcry_essiv_alg_ = 0;
  int gcry_mode_ = 0;
  size_t iv_len_ = 0;
  size_t block_len_ = 0;
  mutable std::mutex mu_;  // guards free_
  mutable std::vector<std::unique_ptr<Handle>> free_;
};

// Requests larger than 64 KiB are split over the worker pool (io::offload) in
// pieces of crypt_chunk_bytes(), so a large request does not hold an event loop.
size_t crypt_chunk_bytes();

// encrypt()/decrypt() for a request: inline on the calling thread up to
// 64 KiB, otherwise in crypt_chunk_bytes() pieces on the worker pool, at once.
Task<Status> encrypt_async(const SectorCipher &cipher, uint64_t offset, std::span<std::byte> data);
Task<Status> decrypt_async(const SectorCipher &cipher, uint64_t offset, std::span<std::byte> data);

}  // namespace qcowfs::image::crypto
