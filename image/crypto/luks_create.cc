#include "image/crypto/luks_create.h"

#include <charconv>

namespace qcowfs::image {

namespace {

constexpr std::string_view kLuksCreateKeys[] = {"cipher-alg", "cipher-mode", "ivgen-alg", "ivgen-hash-alg",
                                                "hash-alg",   "iter-time",   "key-file"};

Status bad_luks_value(std::string_view prefix, std::string_view key, std::string_view value,
                      std::string_view expected) {
  return Status::errorf(EINVAL, "bad value '{}' for option {}{} (expected {})", value, prefix, key, expected);
}

Result<uint32_t> parse_iter_time(std::string_view prefix, std::string_view v) {
  uint32_t n = 0;
  auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
  if (ec != std::errc() || end != v.data() + v.size() || n == 0)
    return bad_luks_value(prefix, "iter-time", v, "milliseconds, at least 1");
  return n;
}

// Checks a name against one of the crypto layer's parsers.
template <typename Parse>
Status check_name(std::string_view prefix, std::string_view key, std::string_view v, Parse parse,
                  std::string_view expected) {
  if (!parse(v)) return bad_luks_value(prefix, key, v, expected);
  return Status::ok();
}

}  // namespace

bool is_luks_create_option(std::string_view key) {
  for (std::string_view k : kLuksCreateKeys)
    if (k == key) return true;
  return false;
}

Status apply_luks_create_option(LuksCreateOptions& o, std::string_view key, std::string_view v,
                                std::string_view prefix) {
  constexpr std::string_view kHashes = "md5, sha1, sha224, sha256, sha384, sha512 or ripemd160";
  if (key == "cipher-alg") {
    QCOWFS_TRY(check_name(prefix, key, v, crypto::parse_cipher_alg,
                          "aes-128, aes-192, aes-256, serpent-128, serpent-192, "
                          "serpent-256, twofish-128, twofish-192, twofish-256 or cast5-128"));
    o.cipher_alg = v;
  } else if (key == "cipher-mode") {
    QCOWFS_TRY(check_name(prefix, key, v, crypto::parse_cipher_mode, "ecb, cbc, xts or ctr"));
    o.cipher_mode = v;
  } else if (key == "ivgen-alg") {
    QCOWFS_TRY(check_name(prefix, key, v, crypto::parse_ivgen_alg, "plain, plain64 or essiv"));
    o.ivgen_alg = v;
  } else if (key == "ivgen-hash-alg" || key == "hash-alg") {
    QCOWFS_TRY(check_name(prefix, key, v, crypto::parse_hash_alg, kHashes));
    (key == "hash-alg" ? o.hash_alg : o.ivgen_hash_alg) = v;
  } else if (key == "iter-time") {
    auto n = parse_iter_time(prefix, v);
    if (!n) return n.status();
    o.iter_time_ms = *n;
  } else if (key == "key-file") {
    if (v.empty()) return bad_luks_value(prefix, key, v, "a file name, or - for standard input");
    o.key_file = v;
  } else {
    return Status::errorf(EINVAL, "unknown create option '{}{}'", prefix, key);
  }
  return Status::ok();
}

Result<crypto::LuksFormatParams> luks_format_params(const LuksCreateOptions& o) {
  crypto::CipherSpec spec;
  spec.alg = *crypto::parse_cipher_alg(o.cipher_alg);
  spec.mode = *crypto::parse_cipher_mode(o.cipher_mode);
  spec.ivgen = *crypto::parse_ivgen_alg(o.ivgen_alg);
  // QEMU: essiv without ivgen-hash-alg hashes with sha256; other IV generators use no hash.
  spec.ivgen_hash = o.ivgen_hash_alg.empty() ? crypto::HashAlg::sha256 : *crypto::parse_hash_alg(o.ivgen_hash_alg);
  QCOWFS_TRY(crypto::check_spec(spec));
  crypto::LuksFormatParams p;
  p.cipher_name = crypto::luks_cipher_name(spec);
  // An ivgen-hash-alg with plain/plain64 is dropped: QEMU writes it ("xts-plain64:sha256", unused there), but
  // libcryptsetup cannot check such a mode without device-mapper.
  p.cipher_mode = crypto::luks_cipher_mode(spec);
  p.key_bytes = spec.key_bytes();
  p.hash = o.hash_alg;
  p.iter_time_ms = o.iter_time_ms;
  p.payload_align = kLuksCreateAlign;
  return p;
}
}  // namespace qcowfs::image
