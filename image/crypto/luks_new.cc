#include "image/crypto/luks_new.h"

#include <fmt/format.h>

#include "image/crypto/secret.h"

namespace qcowfs::image {

Result<crypto::LuksFormatted> format_new_luks(const LuksCreateOptions& o, const std::string& image,
                                              std::string_view key_option) {
  auto params = luks_format_params(o);
  if (!params) return params.status();
  auto keys = o.key_file.empty() ? crypto::KeyProvider::from_terminal() : crypto::KeyProvider::from_file(o.key_file);
  auto pass = keys->passphrase(image);
  if (!pass && pass.status().code() == ENOKEY)
    return Status::errorf(ENOKEY,
                          "{}: the new image is encrypted: give its passphrase with -o {}=PATH ({}=- for "
                          "standard input), or run on a terminal to be asked",
                          image, key_option, key_option);
  if (!pass) return pass.status();
  return crypto::format_luks1(*params, (*pass)->span());
}

std::string luks_formatting(const LuksCreateOptions& o, std::string_view prefix) {
  const LuksCreateOptions d;
  std::string s;
  auto add = [&](std::string_view key, const auto& v, bool given) {
    if (given) s += fmt::format(" {}{}={}", prefix, key, v);
  };
  add("key-file", o.key_file, !o.key_file.empty());
  add("cipher-alg", o.cipher_alg, o.cipher_alg != d.cipher_alg);
  add("cipher-mode", o.cipher_mode, o.cipher_mode != d.cipher_mode);
  add("ivgen-alg", o.ivgen_alg, o.ivgen_alg != d.ivgen_alg);
  add("ivgen-hash-alg", o.ivgen_hash_alg, !o.ivgen_hash_alg.empty());
  add("hash-alg", o.hash_alg, o.hash_alg != d.hash_alg);
  add("iter-time", o.iter_time_ms, o.iter_time_ms != d.iter_time_ms);
  return s;
}

}  // namespace qcowfs::image
