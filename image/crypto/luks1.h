// LUKS1 headers and key slots through libgcrypt: parse_luks1 reads and checks
// the 592-byte phdr (the checks of QEMU's qcrypto_block_luks_check_header plus
// limits on every number that sizes work or memory); unlock_luks1 turns a
// passphrase into the volume key: PBKDF2 per slot, the slot's key material
// decrypted with SectorCipher, the anti-forensic merge (LUKS1 on-disk format
// specification, section "AF-Splitter"), and the master-key digest. This is
// the fallback for key slots libcryptsetup cannot decrypt on this host
// (Serpent, Twofish, CAST5 and 192-bit XTS need AF_ALG or dm-crypt there); it
// gives the same volume key. The only code of our own is the AF merge: ciphers,
// hashes and PBKDF2 are libgcrypt's.
//
// Thread-safety: plain functions over values; parse_luks1 and unlock_luks1
// may run concurrently. unlock_luks1 calls `material` on the calling thread
// and does not keep it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "image/crypto/cipher.h"
#include "image/crypto/secret.h"
#include "io/status.h"

namespace qcowfs::image::crypto {

// On-disk layout (big-endian), LUKS1 on-disk format specification 1.2.3.
inline constexpr size_t kLuks1HeaderBytes = 592;
inline constexpr std::array<std::byte, 6> kLuks1Magic = {std::byte{'L'}, std::byte{'U'},  std::byte{'K'},
                                                         std::byte{'S'}, std::byte{0xba}, std::byte{0xbe}};
inline constexpr uint16_t kLuks1Version = 1;
// The version field (big-endian 16 bits) is at this offset in LUKS1 and LUKS2 headers alike.
inline constexpr size_t kLuksVersionAt = 6;
inline constexpr size_t kLuks1NameBytes = 32;  // cipher_name, mode, hash_spec
inline constexpr size_t kLuks1UuidBytes = 40;
inline constexpr size_t kLuks1DigestBytes = 20;
inline constexpr size_t kLuks1SaltBytes = 32;
inline constexpr size_t kLuks1KeySlots = 8;
inline constexpr size_t kLuks1KeySlotBytes = 48;
inline constexpr size_t kLuks1KeySlotsAt = 208;  // first slot in the phdr
inline constexpr uint32_t kLuks1SlotEnabled = 0x00AC71F3;
inline constexpr uint32_t kLuks1SlotDisabled = 0x0000DEAD;
// Offsets in the header count 512-byte sectors; key material is en/decrypted
// in 512-byte sectors whatever the payload's sector size.
inline constexpr uint32_t kLuks1SectorBytes = 512;
static_assert(kLuks1KeySlotsAt + kLuks1KeySlots * kLuks1KeySlotBytes == kLuks1HeaderBytes);

// Limits checked before any key derivation or read (EINVAL beyond). The
// PBKDF2 limit holds for LUKS1 and LUKS2 alike (crypto/luks.h has argon2's):
// 2^26 is 16-30 times what a 2 s benchmark gives on a fast CPU today.
inline constexpr uint32_t kMaxPbkdf2Iterations = 1u << 26;
inline constexpr uint32_t kLuks1MaxStripes = 65536;  // cryptsetup writes 4000
inline constexpr uint32_t kLuks1MaxKeyBytes = 512;

struct Luks1KeySlot {
  uint32_t active = kLuks1SlotDisabled;  // kLuks1SlotEnabled or ...Disabled
  uint32_t iterations = 0;
  std::array<std::byte, kLuks1SaltBytes> salt{};
  uint32_t key_material_offset = 0;  // sectors from the start of the header
  uint32_t stripes = 0;

  bool enabled() const { return active == kLuks1SlotEnabled; }
};

struct Luks1Header {
  uint16_t version = kLuks1Version;
  std::string cipher_name;      // "aes", "serpent", ...
  std::string cipher_mode;      // "xts-plain64", "cbc-essiv:sha256", ...
  std::string hash_spec;        // "sha256": PBKDF2 and the AF diffusion
  uint32_t payload_offset = 0;  // sectors
  uint32_t key_bytes = 0;       // of the volume key
  std::array<std::byte, kLuks1DigestBytes> mk_digest{};
  std::array<std::byte, kLuks1SaltBytes> mk_digest_salt{};
  uint32_t mk_digest_iter = 0;
  std::string uuid;
  std::array<Luks1KeySlot, kLuks1KeySlots> slots{};

  // Decoded from the strings above by parse_luks1.
  CipherSpec spec;  // sector_size kLuks1SectorBytes
  HashAlg hash = HashAlg::sha256;

  uint64_t payload_bytes() const { return uint64_t{payload_offset} * kLuks1SectorBytes; }
  // key_bytes * stripes: the AF-split key of one slot.
  uint64_t split_key_bytes(const Luks1KeySlot &s) const { return uint64_t{key_bytes} * s.stripes; }
  // The split key rounded up to whole sectors, as it is stored.
  uint64_t material_bytes(const Luks1KeySlot &s) const;
};

// Parses and checks a LUKS1 header. head: at least kLuks1HeaderBytes from the
// start of the image (or of the LUKS area in a qcow2 file); available: the
// bytes of that image or area (key material of an active slot must lie
// inside). Checked: magic, version, NUL-terminated strings, hash_spec and
// cipher known (spec_from_luks), key_bytes, mk_digest_iter and each slot's
// active flag, iterations, stripes, key material after the phdr, not
// overlapping another slot or the payload. EINVAL naming `what`, the slot and
// the value.
Result<Luks1Header> parse_luks1(std::span<const std::byte> head, uint64_t available, std::string_view what);

// Reads `length` bytes at `offset` of the image or LUKS area (fewer is an
// error).
using ReadBytesFn = std::function<Result<std::vector<std::byte>>(uint64_t offset, size_t length)>;

// The volume key (h.key_bytes bytes) for passphrase: every enabled slot in
// order until one gives a key whose PBKDF2 digest is mk_digest. h must come
// from parse_luks1 (its limits bound the work and the reads: at most
// kLuks1MaxKeyBytes * kLuks1MaxStripes bytes of key material per slot). EACCES
// "wrong passphrase for <what> (no key slot accepts it)"; errors of `material`
// or of libgcrypt are returned as they are. Every intermediate key is in a
// SecretBuffer.
Result<SecretBuffer> unlock_luks1(const Luks1Header &h, std::span<const std::byte> passphrase,
                                  const ReadBytesFn &material, std::string_view what);

// The LUKS1 anti-forensic merge: `split` is `stripes` blocks of out.size()
// bytes; out becomes the merged key. Exposed for the tests.
Status luks1_af_merge(std::span<const std::byte> split, HashAlg hash, std::span<std::byte> out);

}  // namespace qcowfs::image::crypto
