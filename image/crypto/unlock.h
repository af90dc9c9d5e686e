// Unlocking a LUKS header into a data cipher: the one entry point the formats
// use (raw LUKS images, LUKS inside qcow2). It asks the KeyProvider for the
// passphrase, unlocks a key slot with libcryptsetup (crypto/luks.h) and, for
// LUKS1 slots whose cipher libcryptsetup's backend cannot run on this host
// (no AF_ALG or device-mapper: Serpent, Twofish, CAST5, 192-bit XTS), with
// the libgcrypt key-slot path (crypto/luks1.h); then makes the SectorCipher.
// Also renders a header as `qemu-img info` shows it.
//
// Thread-safety: plain functions; call them at open, not per request.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "image/crypto/cipher.h"
#include "image/crypto/luks.h"
#include "image/crypto/secret.h"
#include "image/json.h"
#include "io/host_file.h"
#include "io/task.h"

namespace qcowfs::image::crypto {

struct UnlockedLuks {
  LuksInfo info;
  CipherSpec spec;
  std::shared_ptr<const SectorCipher> cipher;
};

// A raw LUKS image read through file (LuksVolume::open_file); what names it in messages.
// EACCES: wrong passphrase (with the key provider's refusal_note when it has one, e.g. a key file
// ending in a newline); ENOKEY: no passphrase given and no terminal.
Task<Result<UnlockedLuks>> unlock_luks_file(io::HostFile& file, KeyProvider& keys, std::string_view what);
// The LUKS area of a qcow2 image (offsets relative to the area).
Result<UnlockedLuks> unlock_luks_area(std::span<const std::byte> area, KeyProvider& keys, std::string_view what);

// The key provider to use: opts' or, without one, the terminal's.
std::shared_ptr<KeyProvider> key_provider_or_terminal(const std::shared_ptr<KeyProvider>& given);

// qemu-img info's view of a LUKS header (QEMU's QCryptoBlockInfoLUKS, in
// its order): ivgen-alg, hash-alg, cipher-alg, uuid, cipher-mode, slots,
// payload-offset, master-key-iters; in_qcow2 adds "format": "luks" (the
// qcow2 "encrypt" block). Needs no key.
Json luks_details(const LuksInfo& info, bool in_qcow2);

}  // namespace qcowfs::image::crypto
