// The LUKS options of qemu-img create (-f luks, and qcow2's -o encrypt.*),
// shared by the formats that make LUKS headers: parsed by QEMU's names with
// its defaults, and turned into the parameters crypto/luks1.h formats with.
// Thread-safety: plain values and pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "image/crypto/luks.h"
#include "io/status.h"

namespace qcowfs::image {

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

}  // namespace qcowfs::image
