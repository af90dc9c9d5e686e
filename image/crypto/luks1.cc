#include "image/crypto/luks1.h"

#include <gcrypt.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>

#include "image/endian.h"

namespace qcowfs::image::crypto {
namespace {

// Field offsets in the phdr (LUKS1 on-disk format specification, table 1).
constexpr size_t kCipherNameAt = 8;
constexpr size_t kCipherModeAt = 40;
constexpr size_t kHashSpecAt = 72;
constexpr size_t kPayloadOffsetAt = 104;
constexpr size_t kKeyBytesAt = 108;
constexpr size_t kMkDigestAt = 112;
constexpr size_t kMkDigestSaltAt = 132;
constexpr size_t kMkDigestIterAt = 164;
constexpr size_t kUuidAt = 168;
// In a key slot.
constexpr size_t kSlotActiveAt = 0;
constexpr size_t kSlotIterationsAt = 4;
constexpr size_t kSlotSaltAt = 8;
constexpr size_t kSlotKeyMaterialAt = 40;
constexpr size_t kSlotStripesAt = 44;
static_assert(kUuidAt + kLuks1UuidBytes == kLuks1KeySlotsAt);
static_assert(kSlotStripesAt + 4 == kLuks1KeySlotBytes);

// The first sector key material may use: the one after the phdr.
constexpr uint64_t kFirstMaterialSector = (kLuks1HeaderBytes + kLuks1SectorBytes - 1) / kLuks1SectorBytes;

int gcry_md_of(HashAlg h) { return gcrypt_md(h); }

Status gcry_status(gcry_error_t e, std::string_view what) {
  const int err = gcry_err_code_to_errno(gcry_err_code(e));
  return Status::errorf(err != 0 ? err : EINVAL, "{}: {}", what, gcry_strerror(e));
}

template <size_t N>
std::array<std::byte, N> bytes_at(std::span<const std::byte> p, size_t at) {
  std::array<std::byte, N> a;
  std::memcpy(a.data(), p.data() + at, N);
  return a;
}

// A string field: NUL-terminated inside its n bytes (the uuid may fill it).
Result<std::string> string_at(std::span<const std::byte> p, size_t at, size_t n, std::string_view field,
                              std::string_view what, bool need_nul = true) {
  const char *s = reinterpret_cast<const char *>(p.data() + at);
  const void *nul = std::memchr(s, '\0', n);
  if (nul == nullptr && need_nul)
    return Status::errorf(EINVAL,
                          "{}: LUKS1 header {} is not NUL-terminated in its "
                          "{} bytes",
                          what, field, n);
  const size_t len = nul ? static_cast<size_t>(static_cast<const char *>(nul) - s) : n;
  return std::string(s, len);
}

Luks1KeySlot slot_at(std::span<const std::byte> p, size_t i) {
  const size_t at = kLuks1KeySlotsAt + i * kLuks1KeySlotBytes;
  Luks1KeySlot s;
  s.active = load_be32(p.data() + at + kSlotActiveAt);
  s.iterations = load_be32(p.data() + at + kSlotIterationsAt);
  s.salt = bytes_at<kLuks1SaltBytes>(p, at + kSlotSaltAt);
  s.key_material_offset = load_be32(p.data() + at + kSlotKeyMaterialAt);
  s.stripes = load_be32(p.data() + at + kSlotStripesAt);
  return s;
}

Status check_prefix(std::span<const std::byte> head, std::string_view what) {
  if (head.size() < kLuks1HeaderBytes)
    return Status::errorf(EINVAL, "{}: LUKS1 header truncated ({} bytes, needs {})", what, head.size(),
                          kLuks1HeaderBytes);
  if (!std::equal(kLuks1Magic.begin(), kLuks1Magic.end(), head.begin()))
    return Status::errorf(EINVAL, "{}: no LUKS magic", what);
  const uint32_t version = load_be16(head.data() + kLuksVersionAt);
  if (version != kLuks1Version)
    return Status::errorf(EINVAL, "{}: LUKS version {} (expected {})", what, version, kLuks1Version);
  return Status::ok();
}

Status read_strings(std::span<const std::byte> head, Luks1Header &h, std::string_view what) {
  auto name = string_at(head, kCipherNameAt, kLuks1NameBytes, "cipher name", what);
  auto mode = string_at(head, kCipherModeAt, kLuks1NameBytes, "cipher mode", what);
  auto hash = string_at(head, kHashSpecAt, kLuks1NameBytes, "hash spec", what);
  auto uuid = string_at(head, kUuidAt, kLuks1UuidBytes, "uuid", what, false);
  for (const auto *r : {&name, &mode, &hash})
    if (!*r) return r->status();
  h.cipher_name = std::move(*name);
  h.cipher_mode = std::move(*mode);
  h.hash_spec = std::move(*hash);
  h.uuid = std::move(*uuid);
  return Status::ok();
}

Status check_algorithms(Luks1Header &h, std::string_view what) {
  auto hash = parse_hash_alg(h.hash_spec);
  if (!hash) return Status::errorf(EINVAL, "{}: unknown LUKS1 hash spec '{}'", what, h.hash_spec);
  h.hash = *hash;
  if (h.key_bytes == 0 || h.key_bytes > kLuks1MaxKeyBytes)
    return Status::errorf(EINVAL, "{}: LUKS1 key of {} bytes (expected 1 to {})", what, h.key_bytes, kLuks1MaxKeyBytes);
  auto spec = spec_from_luks(h.cipher_name, h.cipher_mode, h.key_bytes, kLuks1SectorBytes);
  if (!spec) return spec.status().with_context(what);
  h.spec = *spec;
  if (h.mk_digest_iter == 0 || h.mk_digest_iter > kMaxPbkdf2Iterations)
    return Status::errorf(EINVAL, "{}: LUKS1 master key digest iterations {} (expected 1 to {})", what,
                          h.mk_digest_iter, kMaxPbkdf2Iterations);
  return Status::ok();
}

// Sectors [first, end) of a slot's key material.
struct SectorRange {
  uint64_t first;
  uint64_t end;
};

SectorRange material_sectors(const Luks1Header &h, const Luks1KeySlot &s) {
  return {s.key_material_offset, s.key_material_offset + h.material_bytes(s) / kLuks1SectorBytes};
}

Status check_slot(const Luks1Header &h, size_t i, uint64_t available, std::string_view what) {
  const Luks1KeySlot &s = h.slots[i];
  if (s.active != kLuks1SlotEnabled && s.active != kLuks1SlotDisabled)
    return Status::errorf(EINVAL,
                          "{}: LUKS1 key slot {} state {:#x} is neither enabled nor "
                          "disabled",
                          what, i, s.active);
  if (s.stripes == 0 || s.stripes > kLuks1MaxStripes)
    return Status::errorf(EINVAL,
                          "{}: LUKS1 key slot {} has {} stripes (expected 1 "
                          "to {})",
                          what, i, s.stripes, kLuks1MaxStripes);
  // Iterations over the limit make the slot unusable, not the header:
  // unlock_luks1 skips it and tries the others.
  if (s.enabled() && s.iterations == 0)
    return Status::errorf(EINVAL, "{}: LUKS1 key slot {} has 0 iterations", what, i);
  const SectorRange r = material_sectors(h, s);
  if (r.first < kFirstMaterialSector)
    return Status::errorf(EINVAL,
                          "{}: LUKS1 key slot {} key material at sector {} "
                          "overlaps the header",
                          what, i, r.first);
  if (s.enabled() && r.end * kLuks1SectorBytes > available)
    return Status::errorf(EINVAL,
                          "{}: LUKS1 key slot {} key material (sectors {} to "
                          "{}) lies past the end ({} bytes)",
                          what, i, r.first, r.end - 1, available);
  if (r.end > h.payload_offset)
    return Status::errorf(EINVAL,
                          "{}: LUKS1 key slot {} key material (sectors {} to "
                          "{}) overlaps the payload at sector {}",
                          what, i, r.first, r.end - 1, h.payload_offset);
  return Status::ok();
}

Status check_overlaps(const Luks1Header &h, std::string_view what) {
  for (size_t i = 0; i < kLuks1KeySlots; ++i) {
    const SectorRange a = material_sectors(h, h.slots[i]);
    for (size_t j = i + 1; j < kLuks1KeySlots; ++j) {
      const SectorRange b = material_sectors(h, h.slots[j]);
      if (a.first < b.end && b.first < a.end)
        return Status::errorf(EINVAL,
                              "{}: LUKS1 key slots {} and {} overlap (sectors "
                              "{} to {} and {} to {})",
                              what, i, j, a.first, a.end - 1, b.first, b.end - 1);
    }
  }
  return Status::ok();
}

struct MdClose {
  void operator()(gcry_md_hd_t h) const { gcry_md_close(h); }
};
using MdHandle = std::unique_ptr<gcry_md_handle, MdClose>;

Result<MdHandle> open_md(HashAlg hash) {
  gcry_md_hd_t h = nullptr;
  const gcry_error_t e = gcry_md_open(&h, gcry_md_of(hash), GCRY_MD_FLAG_SECURE);
  if (e) return gcry_status(e, fmt::format("opening hash {}", name_of(hash)));
  return MdHandle(h);
}

// The AF diffusion of one block, in place: the block cut into digest-sized
// pieces (the last may be shorter), piece i replaced by the first bytes of
// hash(be32(i) || piece i).
void diffuse(gcry_md_hd_t md, size_t digest, std::span<std::byte> block) {
  for (size_t at = 0, i = 0; at < block.size(); at += digest, ++i) {
    const size_t n = std::min(digest, block.size() - at);
    const std::array<uint8_t, 4> iv = {static_cast<uint8_t>(i >> 24), static_cast<uint8_t>(i >> 16),
                                       static_cast<uint8_t>(i >> 8), static_cast<uint8_t>(i)};
    gcry_md_reset(md);
    gcry_md_write(md, iv.data(), iv.size());
    gcry_md_write(md, block.data() + at, n);
    std::memcpy(block.data() + at, gcry_md_read(md, 0), n);
  }
}

void xor_into(std::span<std::byte> dst, std::span<const std::byte> src) {
  for (size_t i = 0; i < dst.size(); ++i) dst[i] ^= src[i];
}

Result<SecretBuffer> pbkdf2(HashAlg hash, std::span<const std::byte> secret, std::span<const std::byte> salt,
                            uint32_t iterations, size_t out_bytes) {
  auto out = SecretBuffer::allocate(out_bytes);
  if (!out) return out.status();
  static const std::byte kEmpty{};  // libgcrypt refuses a null passphrase
  const void *p = secret.empty() ? &kEmpty : secret.data();
  const gcry_error_t e = gcry_kdf_derive(p, secret.size(), GCRY_KDF_PBKDF2, gcry_md_of(hash), salt.data(), salt.size(),
                                         iterations, out->size(), out->data());
  if (e) return gcry_status(e, fmt::format("PBKDF2-{}", name_of(hash)));
  return out;
}

bool same_bytes(std::span<const std::byte> a, std::span<const std::byte> b) {
  if (a.size() != b.size()) return false;
  std::byte diff{0};
  for (size_t i = 0; i < a.size(); ++i) diff |= a[i] ^ b[i];
  return diff == std::byte{0};
}

// The slot's split key, read and decrypted (IV sector 0 at its first byte).
Result<SecretBuffer> decrypt_material(const Luks1Header &h, const Luks1KeySlot &s, const SecretBuffer &slot_key,
                                      const ReadBytesFn &material, std::string_view what) {
  const uint64_t offset = uint64_t{s.key_material_offset} * kLuks1SectorBytes;
  const size_t length = static_cast<size_t>(h.material_bytes(s));
  auto bytes = material(offset, length);
  if (!bytes) return bytes.status();
  if (bytes->size() != length)
    return Status::errorf(EIO,
                          "{}: short read of LUKS1 key material at {:#x} "
                          "({} of {} bytes)",
                          what, offset, bytes->size(), length);
  auto split = SecretBuffer::copy_of(*bytes);
  if (!split) return split.status();
  auto cipher = SectorCipher::create(h.spec, slot_key.span());
  if (!cipher) return cipher.status().with_context(what);
  QCOWFS_TRY((*cipher)->decrypt(0, split->span()));
  split->shrink(static_cast<size_t>(h.split_key_bytes(s)));
  return split;
}

// The volume key if slot s accepts the passphrase, an empty buffer if not.
Result<SecretBuffer> try_slot(const Luks1Header &h, const Luks1KeySlot &s, std::span<const std::byte> passphrase,
                              const ReadBytesFn &material, std::string_view what) {
  auto slot_key = pbkdf2(h.hash, passphrase, s.salt, s.iterations, h.key_bytes);
  if (!slot_key) return slot_key.status();
  auto split = decrypt_material(h, s, *slot_key, material, what);
  if (!split) return split.status();
  auto candidate = SecretBuffer::allocate(h.key_bytes);
  if (!candidate) return candidate.status();
  QCOWFS_TRY(luks1_af_merge(split->span(), h.hash, candidate->span()));
  auto digest = pbkdf2(h.hash, candidate->span(), h.mk_digest_salt, h.mk_digest_iter, kLuks1DigestBytes);
  if (!digest) return digest.status();
  if (!same_bytes(digest->span(), h.mk_digest)) return SecretBuffer();
  return candidate;
}

}  // namespace

uint64_t Luks1Header::material_bytes(const Luks1KeySlot &s) const {
  const uint64_t n = split_key_bytes(s);
  return (n + kLuks1SectorBytes - 1) / kLuks1SectorBytes * kLuks1SectorBytes;
}

Result<Luks1Header> parse_luks1(std::span<const std::byte> head, uint64_t available, std::string_view what) {
  QCOWFS_TRY(check_prefix(head, what));
  Luks1Header h;
  QCOWFS_TRY(read_strings(head, h, what));
  h.payload_offset = load_be32(head.data() + kPayloadOffsetAt);
  h.key_bytes = load_be32(head.data() + kKeyBytesAt);
  h.mk_digest = bytes_at<kLuks1DigestBytes>(head, kMkDigestAt);
  h.mk_digest_salt = bytes_at<kLuks1SaltBytes>(head, kMkDigestSaltAt);
  h.mk_digest_iter = load_be32(head.data() + kMkDigestIterAt);
  QCOWFS_TRY(check_algorithms(h, what));
  for (size_t i = 0; i < kLuks1KeySlots; ++i) {
    h.slots[i] = slot_at(head, i);
    QCOWFS_TRY(check_slot(h, i, available, what));
  }
  QCOWFS_TRY(check_overlaps(h, what));
  return h;
}

Status luks1_af_merge(std::span<const std::byte> split, HashAlg hash, std::span<std::byte> out) {
  const size_t n = out.size();
  if (n == 0 || split.size() % n != 0 || split.empty())
    return Status::errorf(EINVAL,
                          "AF merge of {} bytes into a {}-byte key: not whole "
                          "stripes",
                          split.size(), n);
  init_gcrypt();
  auto md = open_md(hash);
  if (!md) return md.status();
  const size_t digest = digest_bytes(hash);
  auto acc = SecretBuffer::allocate(n);
  if (!acc) return acc.status();
  const size_t stripes = split.size() / n;
  for (size_t i = 0; i + 1 < stripes; ++i) {
    xor_into(acc->span(), split.subspan(i * n, n));
    diffuse(md->get(), digest, acc->span());
  }
  std::memcpy(out.data(), acc->data(), n);
  xor_into(out, split.subspan((stripes - 1) * n, n));
  return Status::ok();
}

Result<SecretBuffer> unlock_luks1(const Luks1Header &h, std::span<const std::byte> passphrase,
                                  const ReadBytesFn &material, std::string_view what) {
  init_gcrypt();
  std::string skipped;  // slots over the derivation limit, never tried
  bool tried = false;
  for (size_t i = 0; i < h.slots.size(); ++i) {
    const Luks1KeySlot &s = h.slots[i];
    if (!s.enabled()) continue;
    if (s.iterations > kMaxPbkdf2Iterations) {
      skipped = fmt::format("{}: LUKS key slot {}: pbkdf2 iterations {} exceeds the limit of {}", what, i, s.iterations,
                            kMaxPbkdf2Iterations);
      continue;
    }
    tried = true;
    auto key = try_slot(h, s, passphrase, material, what);
    if (!key || !key->empty()) return key;
  }
  if (!tried && !skipped.empty()) return Status::error(EINVAL, skipped);
  return Status::errorf(EACCES, "wrong passphrase for {} (no key slot accepts it{})", what,
                        skipped.empty() ? "" : "; not tried: " + skipped);
}

}  // namespace qcowfs::image::crypto
