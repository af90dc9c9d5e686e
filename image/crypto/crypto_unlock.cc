#include "image/crypto/crypto_unlock.h"

#include <sys/prctl.h>

#include <algorithm>
#include <cstring>
#include <fstream>

#include "image/crypto/crypto_luks1.h"
#include "io/log.h"

namespace qcowfs::image::crypto {
namespace {

// No core dump or ptrace attach by other users once a volume key is in the
// process (the keys are also in locked, non-dumpable pages).
void protect_process() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (::prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0) log::warn("prctl(PR_SET_DUMPABLE, 0): {}", std::strerror(errno));
  });
}

// The volume key through libcryptsetup, or for LUKS1 through libgcrypt when
// libcryptsetup cannot run the key slots' cipher here. A wrong passphrase is
// EACCES either way.
Result<SecretBuffer> unlock_key(const LuksVolume& vol, std::span<const std::byte> pass, const ReadBytesFn& read,
                                std::string_view what) {
  auto key = vol.unlock(pass);
  if (key || key.status().code() == EACCES || vol.info().version != 1) return key;
  log::debug("{}: libcryptsetup cannot unlock a key slot ({}); trying the libgcrypt key-slot path", what,
             key.status().message());
  auto head = read(0, kLuks1HeaderBytes);
  if (!head) return head.status();
  auto h = parse_luks1(*head, UINT64_MAX, what);
  if (!h) return h.status();
  return unlock_luks1(*h, pass, read, what);
}

Result<UnlockedLuks> finish(const LuksVolume& vol, KeyProvider& keys, const ReadBytesFn& read, std::string_view what) {
  UnlockedLuks u;
  u.info = vol.info();
  auto spec = spec_from_luks(u.info.cipher_name, u.info.cipher_mode, u.info.key_bytes, u.info.sector_size);
  if (!spec) return spec.status().with_context(std::string(what));
  u.spec = *spec;
  auto pass = keys.passphrase(what);
  if (!pass) return pass.status();
  auto key = unlock_key(vol, (*pass)->span(), read, what);
  if (!key) return key.status();
  protect_process();
  auto cipher = SectorCipher::create(u.spec, key->span());
  if (!cipher) return cipher.status().with_context(std::string(what));
  u.cipher = std::move(*cipher);
  return u;
}

}  // namespace

Result<UnlockedLuks> unlock_luks_file(const std::string& path, KeyProvider& keys, std::string_view what) {
  auto vol = LuksVolume::open_file(path, what);
  if (!vol) return vol.status();
  const ReadBytesFn read = [&path, what](uint64_t off, size_t len) -> Result<std::vector<std::byte>> {
    std::ifstream in(path, std::ios::binary);
    std::vector<std::byte> out(len);
    in.seekg(static_cast<std::streamoff>(off));
    in.read(reinterpret_cast<char*>(out.data()), static_cast<std::streamsize>(len));
    if (in.bad()) return Status::errorf(EIO, "{}: reading the LUKS key material at {}", what, off);
    out.resize(static_cast<size_t>(std::max<std::streamsize>(in.gcount(), 0)));
    out.resize(len);  // past the end: zeros (the parser has checked the bounds)
    return out;
  };
  return finish(*vol, keys, read, what);
}

Result<UnlockedLuks> unlock_luks_area(std::span<const std::byte> area, KeyProvider& keys, std::string_view what) {
  auto vol = LuksVolume::open_bytes(area, what);
  if (!vol) return vol.status();
  const ReadBytesFn read = [area](uint64_t off, size_t len) -> Result<std::vector<std::byte>> {
    std::vector<std::byte> out(len);
    if (off < area.size()) {
      const size_t n = std::min<uint64_t>(len, area.size() - off);
      std::memcpy(out.data(), area.data() + off, n);
    }
    return out;
  };
  return finish(*vol, keys, read, what);
}

std::shared_ptr<KeyProvider> key_provider_or_terminal(const std::shared_ptr<KeyProvider>& given) {
  return given ? given : KeyProvider::from_terminal();
}

Json luks_details(const LuksInfo& info, bool in_qcow2) {
  // A cipher this host cannot run is still described, by its header strings.
  auto spec = spec_from_luks(info.cipher_name, info.cipher_mode, info.key_bytes, info.sector_size);
  std::string alg = info.cipher_name, mode = info.cipher_mode, ivgen;
  if (spec) {
    alg = name_of(spec->alg);
    mode = name_of(spec->mode);
    ivgen = name_of(spec->ivgen);
  }
  Json j = Json::object();
  // The order qemu-img prints (its QDict's).
  if (!ivgen.empty()) j.set("ivgen-alg", ivgen);
  j.set("hash-alg", info.hash);
  j.set("cipher-alg", alg);
  j.set("uuid", info.uuid);
  if (spec && spec->ivgen == IvGenAlg::essiv) j.set("ivgen-hash-alg", std::string(name_of(spec->ivgen_hash)));
  if (in_qcow2) j.set("format", "luks");
  j.set("cipher-mode", mode);
  Json slots = Json::array();
  for (const LuksKeySlotInfo& s : info.slots) {
    Json o = Json::object();
    o.set("active", s.active);
    if (s.active) o.set("iters", static_cast<uint64_t>(s.iterations));
    o.set("key-offset", s.key_offset);
    if (s.active) o.set("stripes", static_cast<uint64_t>(s.stripes));
    slots.push(std::move(o));
  }
  j.set("slots", std::move(slots));
  j.set("payload-offset", info.payload_offset);
  j.set("master-key-iters", static_cast<uint64_t>(info.master_key_iterations));
  return j;
}

}  // namespace qcowfs::image::crypto
