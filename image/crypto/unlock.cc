#include "image/crypto/unlock.h"

#include <sys/prctl.h>

#include <algorithm>
#include <cstring>
#include <mutex>

#include "image/crypto/luks1.h"
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
Result<SecretBuffer> unlock_key(const LuksVolume& vol, std::span<const std::byte> pass, std::string_view what) {
  auto key = vol.unlock(pass);
  if (key || key.status().code() == EACCES || vol.info().version != 1) return key;
  log::debug("{}: libcryptsetup cannot unlock a key slot ({}); trying the libgcrypt key-slot path", what,
             key.status().message());
  const ReadBytesFn read = [&vol](uint64_t off, size_t len) { return vol.header_bytes(off, len); };
  auto head = read(0, kLuks1HeaderBytes);
  if (!head) return head.status();
  auto h = parse_luks1(*head, UINT64_MAX, what);
  if (!h) return h.status();
  return unlock_luks1(*h, pass, read, what);
}

// A refused passphrase, with the key provider's note when it has one (a key file ending in a newline).
Status refused(const Status& st, KeyProvider& keys) {
  if (st.code() != EACCES) return st;
  const std::string note = keys.refusal_note();
  if (note.empty()) return st;
  return Status::errorf(EACCES, "{} ({})", st.message(), note);
}

Result<UnlockedLuks> finish(const LuksVolume& vol, KeyProvider& keys, std::string_view what) {
  UnlockedLuks u;
  u.info = vol.info();
  auto spec = spec_from_luks(u.info.cipher_name, u.info.cipher_mode, u.info.key_bytes, u.info.sector_size);
  if (!spec) return spec.status().with_context(std::string(what));
  u.spec = *spec;
  auto pass = keys.passphrase(what);
  if (!pass) return pass.status();
  auto key = unlock_key(vol, (*pass)->span(), what);
  if (!key) return refused(key.status(), keys);
  protect_process();
  auto cipher = SectorCipher::create(u.spec, key->span());
  if (!cipher) return cipher.status().with_context(std::string(what));
  u.cipher = std::move(*cipher);
  return u;
}

}  // namespace

Task<Result<UnlockedLuks>> unlock_luks_file(io::HostFile& file, KeyProvider& keys, std::string_view what) {
  auto vol = co_await LuksVolume::open_file(file, what);
  if (!vol) co_return vol.status();
  co_return finish(*vol, keys, what);
}

Result<UnlockedLuks> unlock_luks_area(std::span<const std::byte> area, KeyProvider& keys, std::string_view what) {
  auto vol = LuksVolume::open_bytes(area, what);
  if (!vol) return vol.status();
  return finish(*vol, keys, what);
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
