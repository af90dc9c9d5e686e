// LUKS headers and key slots (crypto/luks.h): the binary header parser, the
// libcryptsetup handle (LuksVolume) and LUKS1 creation.
#include "image/crypto/luks.h"

#include <json-c/json.h>
#include <libcryptsetup.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <optional>
#include <utility>

#include "image/crypto/cipher.h"
#include "image/crypto/luks1.h"
#include "image/endian.h"
#include "image/extent/host_read.h"
#include "io/fd.h"
#include "io/log.h"

namespace qcowfs::image::crypto {

namespace {

// ---- Bytes of the binary headers ---------------------------------------------------------------

// A NUL-terminated string in a fixed-size field; nullopt when the field has no NUL.
std::optional<std::string> field_string(std::span<const std::byte> b, size_t at, size_t len) {
  const char* p = reinterpret_cast<const char*>(b.data() + at);
  const void* nul = std::memchr(p, 0, len);
  if (nul == nullptr) return std::nullopt;
  return std::string(p, static_cast<const char*>(nul));
}

Status invalid(std::string_view what, std::string_view why) {
  return Status::errorf(EINVAL, "{}: invalid LUKS header: {}", what, why);
}

// LUKS2 binary header field offsets.
constexpr size_t kL2HdrSize = 8, kL2Label = 24, kL2LabelLen = 48, kL2ChecksumAlg = 72, kL2ChecksumAlgLen = 32,
                 kL2Uuid = 168, kL2UuidLen = 40, kL2HdrOffset = 256;


// ---- LUKS1 ---------------------------------------------------------------------------------------

uint64_t div_round_up(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

// Sectors of one slot's anti-forensic material, as QEMU counts them for its overlap checks
// (qcrypto_block_luks_splitkeylen_sectors: rounded up to the 4096-byte header alignment).
uint64_t qemu_split_sectors(uint64_t key_bytes, uint32_t stripes) {
  constexpr uint64_t kAlignSectors = 4096 / kLuks1SectorBytes;
  return div_round_up(div_round_up(key_bytes * stripes, kLuks1SectorBytes), kAlignSectors) * kAlignSectors;
}

// LUKS1 headers are parsed by crypto/luks1.h (parse_luks1, the same checks
// the key-slot fallback relies on); this is its view as LuksInfo.
LuksInfo luks1_info(const Luks1Header& h) {
  LuksInfo info;
  info.version = kLuksVersion1;
  info.cipher_name = h.cipher_name;
  info.cipher_mode = h.cipher_mode;
  info.key_bytes = h.key_bytes;
  info.hash = h.hash_spec;
  info.uuid = h.uuid;
  info.payload_offset = h.payload_bytes();
  info.master_key_iterations = h.mk_digest_iter;
  info.metadata_bytes = kLuks1HeaderBytes;
  for (unsigned i = 0; i < kLuks1KeySlots; ++i) {
    const Luks1KeySlot& s = h.slots[i];
    LuksKeySlotInfo slot;
    slot.index = i;
    slot.active = s.enabled();
    slot.iterations = s.iterations;
    slot.stripes = s.stripes;
    slot.key_offset = uint64_t{s.key_material_offset} * kLuks1SectorBytes;
    slot.key_length = h.material_bytes(s);
    slot.pbkdf = "pbkdf2";
    slot.hash = h.hash_spec;
    if (slot.active) info.metadata_bytes = std::max(info.metadata_bytes, slot.key_offset + slot.key_length);
    info.slots.push_back(std::move(slot));
  }
  return info;
}

Result<LuksInfo> parse_luks2(std::span<const std::byte> head, uint64_t available, std::string_view what) {
  if (head.size() < kLuks2BinaryHeaderBytes)
    return invalid(what, fmt::format("truncated LUKS2 header ({} of {} bytes)", head.size(), kLuks2BinaryHeaderBytes));
  LuksInfo info;
  info.version = kLuksVersion2;
  const uint64_t hdr_size = load_be64(head.data() + kL2HdrSize);
  if (hdr_size < kLuks2MinHeaderBytes || hdr_size > kLuks2MaxHeaderBytes || (hdr_size & (hdr_size - 1)) != 0)
    return invalid(what, fmt::format("LUKS2 header size {} is not a power of two in {}..{}", hdr_size,
                                     kLuks2MinHeaderBytes, kLuks2MaxHeaderBytes));
  if (hdr_size > available)
    return invalid(
        what, fmt::format("LUKS2 header size {} is past the end of the header area ({} bytes)", hdr_size, available));
  if (load_be64(head.data() + kL2HdrOffset) != 0) return invalid(what, "LUKS2 primary header has a non-zero header offset");
  auto csum = field_string(head, kL2ChecksumAlg, kL2ChecksumAlgLen);
  auto uuid = field_string(head, kL2Uuid, kL2UuidLen);
  auto label = field_string(head, kL2Label, kL2LabelLen);
  if (!csum || csum->empty()) return invalid(what, "LUKS2 checksum algorithm is missing or not NUL-terminated");
  if (!uuid) return invalid(what, "uuid is not NUL-terminated");
  if (!label) return invalid(what, "LUKS2 label is not NUL-terminated");
  info.uuid = std::move(*uuid);
  info.label = std::move(*label);
  info.sector_size = 0;  // from the segment, through libcryptsetup
  info.metadata_bytes = std::min(2 * hdr_size, available);
  return info;
}

// ---- The JSON libcryptsetup hands back (crypt_dump_json) ----------------------------------------

// LUKS2's JSON as libcryptsetup hands it over (crypt_dump_json, after its own
// validation), read with json-c. Owned by one json_object tree.
struct JsonPut {
  void operator()(json_object* o) const { json_object_put(o); }
};
using JsonTree = std::unique_ptr<json_object, JsonPut>;

json_object* json_member(json_object* obj, const char* key) {
  json_object* out = nullptr;
  if (obj == nullptr || !json_object_is_type(obj, json_type_object) || !json_object_object_get_ex(obj, key, &out))
    return nullptr;
  return out;
}

// The first member's value of an object (the first digest), or null.
json_object* json_first_member(json_object* obj) {
  if (obj == nullptr || !json_object_is_type(obj, json_type_object)) return nullptr;
  json_object_object_foreach(obj, key, value) {
    (void)key;
    return value;
  }
  return nullptr;
}

std::string json_text(json_object* v) {
  return v != nullptr && json_object_is_type(v, json_type_string) ? json_object_get_string(v) : std::string();
}

// An unsigned number, bare or as a string (LUKS2 writes 64-bit values as strings); 0 when neither.
uint64_t json_uint(json_object* v) {
  if (v == nullptr) return 0;
  if (json_object_is_type(v, json_type_int)) return json_object_get_uint64(v);
  const std::string t = json_text(v);
  if (t.empty() || t.size() > 19 || t.find_first_not_of("0123456789") != std::string::npos) return 0;
  return std::stoull(t);
}

// ---- libcryptsetup set-up, logging and errors -------------------------------------------------------

// The last error libcryptsetup logged on this thread, for the Status message.
thread_local std::string last_library_error;

void library_log(int level, const char* msg, void* /*usrptr*/) {
  std::string_view m = msg != nullptr ? msg : "";
  while (!m.empty() && (m.back() == '\n' || m.back() == ' ')) m.remove_suffix(1);
  if (level == CRYPT_LOG_ERROR) last_library_error = m;
  log::debug("libcryptsetup: {}", m);
}

void init_library() {
  static std::once_flag once;
  std::call_once(once, [] {
    crypt_set_log_callback(nullptr, &library_log, nullptr);
    // No /run/cryptsetup lock files: works unprivileged, and our headers are private copies or read-only.
    crypt_metadata_locking(nullptr, 0);
  });
}

// A libcryptsetup failure (r: a negative errno) as a Status naming what and the operation.
Status library_error(int r, std::string_view what, std::string_view op) {
  const int err = r < 0 ? -r : EIO;
  std::string detail = std::exchange(last_library_error, {});
  return Status::errorf(err, "{}: {} failed: {}{}{}{}", what, op, std::strerror(err), detail.empty() ? "" : " (",
                        detail, detail.empty() ? "" : ")");
}

Status check_slot_key_material(const LuksKeySlotInfo& slot, std::string_view what) {
  if (slot.key_length > kMaxLuksHeaderBytes)
    return Status::errorf(EINVAL, "{}: LUKS key slot {} key material of {} bytes exceeds the limit of {}", what,
                          slot.index, slot.key_length, kMaxLuksHeaderBytes);
  return Status::ok();
}

}  // namespace

// ---- Public: parser and limits ---------------------------------------------------------------------

Result<LuksInfo> parse_luks_header(std::span<const std::byte> head, uint64_t available, std::string_view what) {
  if (head.size() < kLuksMagic.size() + 2 || !std::equal(kLuksMagic.begin(), kLuksMagic.end(), head.begin()))
    return Status::errorf(EINVAL, "{}: not a LUKS header", what);
  const uint16_t version = load_be16(head.data() + kLuksVersionAt);
  if (version == kLuksVersion1) {
    auto h = parse_luks1(head, available, what);
    if (!h) return h.status();
    return luks1_info(*h);
  }
  if (version == kLuksVersion2) return parse_luks2(head, available, what);
  return Status::errorf(ENOTSUP, "{}: LUKS version {} is not supported (1 and 2 are)", what, version);
}

Status check_luks_slot_limits(const LuksKeySlotInfo& slot, std::string_view what) {
  auto over = [&](std::string_view field, uint64_t value, uint64_t limit) {
    return Status::errorf(EINVAL, "{}: LUKS key slot {}: {} {} {} exceeds the limit of {}", what, slot.index,
                          slot.pbkdf, field, value, limit);
  };
  QCOWFS_TRY(check_slot_key_material(slot, what));
  if (slot.pbkdf == CRYPT_KDF_PBKDF2) {
    if (slot.iterations > kMaxPbkdf2Iterations) return over("iterations", slot.iterations, kMaxPbkdf2Iterations);
    if (slot.iterations == 0) return Status::errorf(EINVAL, "{}: LUKS key slot {} has 0 iterations", what, slot.index);
    return Status::ok();
  }
  if (slot.pbkdf == CRYPT_KDF_ARGON2I || slot.pbkdf == CRYPT_KDF_ARGON2ID) {
    if (slot.memory_kib > kMaxArgon2MemoryKiB) return over("memory (KiB)", slot.memory_kib, kMaxArgon2MemoryKiB);
    if (slot.iterations > kMaxArgon2Iterations) return over("time cost", slot.iterations, kMaxArgon2Iterations);
    if (slot.parallel > kMaxArgon2Parallel) return over("parallel threads", slot.parallel, kMaxArgon2Parallel);
    return Status::ok();
  }
  return Status::errorf(EINVAL, "{}: LUKS key slot {} uses an unknown key derivation '{}'", what, slot.index,
                        slot.pbkdf);
}

// ---- LuksVolume ---------------------------------------------------------------------------------------

// The bytes of a header in an anonymous memory file that libcryptsetup opens by path.
class LuksVolume::Memfd {
 public:
  static Result<std::shared_ptr<Memfd>> create(uint64_t size, std::string_view what) {
    io::UniqueFd fd(memfd_create("qcowfs-luks", MFD_CLOEXEC));
    if (!fd.valid()) return Status::from_errno(errno, fmt::format("{}: memfd_create for the LUKS header", what));
    if (ftruncate(fd.get(), static_cast<off_t>(size)) != 0)
      return Status::from_errno(errno, fmt::format("{}: sizing the LUKS header memfd", what));
    return std::make_shared<Memfd>(std::move(fd));
  }
  explicit Memfd(io::UniqueFd fd) : fd_(std::move(fd)), path_(fmt::format("/proc/self/fd/{}", fd_.get())) {}

  Status write_at(uint64_t off, std::span<const std::byte> bytes, std::string_view what) const {
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n =
          pwrite(fd_.get(), bytes.data() + done, bytes.size() - done, static_cast<off_t>(off + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0)
        return Status::from_errno(n < 0 ? errno : EIO, fmt::format("{}: writing the LUKS header memfd", what));
      done += static_cast<size_t>(n);
    }
    return Status::ok();
  }
  // len bytes at off; zeros past the memfd's end.
  Result<std::vector<std::byte>> read_at(uint64_t off, size_t len, std::string_view what) const {
    std::vector<std::byte> out(len);
    size_t done = 0;
    while (done < out.size()) {
      const ssize_t n = pread(fd_.get(), out.data() + done, out.size() - done, static_cast<off_t>(off + done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return Status::from_errno(errno, fmt::format("{}: reading the LUKS header memfd", what));
      if (n == 0) break;
      done += static_cast<size_t>(n);
    }
    return out;
  }
  const std::string& path() const { return path_; }

 private:
  io::UniqueFd fd_;
  std::string path_;
};

void LuksVolume::CryptFree::operator()(crypt_device* cd) const { crypt_free(cd); }

LuksVolume::LuksVolume(Device cd, std::shared_ptr<Memfd> memfd, LuksInfo info, std::string what)
    : cd_(std::move(cd)), memfd_(std::move(memfd)), info_(std::move(info)), what_(std::move(what)) {}
LuksVolume::LuksVolume(LuksVolume&&) noexcept = default;
LuksVolume& LuksVolume::operator=(LuksVolume&&) noexcept = default;
LuksVolume::~LuksVolume() = default;

namespace {

// libcryptsetup's view of one key slot over what the parser found (LUKS1) or nothing (LUKS2).
LuksKeySlotInfo slot_from_library(crypt_device* cd, int index, LuksKeySlotInfo slot) {
  slot.index = static_cast<unsigned>(index);
  const crypt_keyslot_info status = crypt_keyslot_status(cd, index);
  slot.active = status == CRYPT_SLOT_ACTIVE || status == CRYPT_SLOT_ACTIVE_LAST;
  crypt_pbkdf_type pbkdf{};
  if (crypt_keyslot_get_pbkdf(cd, index, &pbkdf) == 0) {
    if (pbkdf.type != nullptr) slot.pbkdf = pbkdf.type;
    slot.hash = pbkdf.hash != nullptr && slot.pbkdf == CRYPT_KDF_PBKDF2 ? pbkdf.hash : "";
    slot.iterations = pbkdf.iterations;
    slot.memory_kib = pbkdf.max_memory_kb;
    slot.parallel = pbkdf.parallel_threads;
  }
  uint64_t offset = 0, length = 0;
  if (crypt_keyslot_area(cd, index, &offset, &length) == 0) {
    slot.key_offset = offset;
    slot.key_length = length;
  }
  return slot;
}

// LUKS2 fields libcryptsetup has no getter for: af.stripes of each slot, the digest's hash and the
// keyslots area size.
void fill_from_json(crypt_device* cd, LuksInfo& info) {
  const char* text = nullptr;
  if (crypt_dump_json(cd, &text, 0) < 0 || text == nullptr) return;
  const JsonTree tree(json_tokener_parse(text));
  json_object* json = tree.get();
  if (json == nullptr) return;
  json_object* keyslots = json_member(json, "keyslots");
  for (auto& slot : info.slots) {
    json_object* ks = json_member(keyslots, std::to_string(slot.index).c_str());
    slot.stripes =
        static_cast<uint32_t>(std::min<uint64_t>(json_uint(json_member(json_member(ks, "af"), "stripes")), UINT32_MAX));
  }
  info.hash = json_text(json_member(json_first_member(json_member(json, "digests")), "hash"));
  const uint64_t keyslots_size = json_uint(json_member(json_member(json, "config"), "keyslots_size"));
  const uint64_t json_size = json_uint(json_member(json_member(json, "config"), "json_size"));
  if (keyslots_size > 0 && json_size > 0)
    info.metadata_bytes = std::max(info.metadata_bytes, 2 * (json_size + kLuks2BinaryHeaderBytes) + keyslots_size);
}

void fill_from_library(crypt_device* cd, LuksInfo& info) {
  if (const char* c = crypt_get_cipher(cd)) info.cipher_name = c;
  if (const char* m = crypt_get_cipher_mode(cd)) info.cipher_mode = m;
  if (const int k = crypt_get_volume_key_size(cd); k > 0) info.key_bytes = static_cast<size_t>(k);
  info.payload_offset = crypt_get_data_offset(cd) * kLuks1SectorBytes;
  if (const int s = crypt_get_sector_size(cd); s > 0) info.sector_size = static_cast<uint32_t>(s);
  if (const char* u = crypt_get_uuid(cd)) info.uuid = u;
  const char* type = info.version == kLuksVersion1 ? CRYPT_LUKS1 : CRYPT_LUKS2;
  const int max_slots = std::max(crypt_keyslot_max(type), 0);
  std::vector<LuksKeySlotInfo> slots;
  for (int i = 0; i < max_slots; ++i) {
    const bool v1 = info.version == kLuksVersion1;
    const crypt_keyslot_info status = crypt_keyslot_status(cd, i);
    if (!v1 && (status == CRYPT_SLOT_INACTIVE || status == CRYPT_SLOT_INVALID)) continue;
    LuksKeySlotInfo parsed =
        v1 && static_cast<size_t>(i) < info.slots.size() ? info.slots[static_cast<size_t>(i)] : LuksKeySlotInfo{};
    slots.push_back(slot_from_library(cd, i, std::move(parsed)));
    info.metadata_bytes = std::max(info.metadata_bytes, slots.back().key_offset + slots.back().key_length);
  }
  info.slots = std::move(slots);
  if (info.version == kLuksVersion2) fill_from_json(cd, info);
}

}  // namespace

Result<LuksVolume> LuksVolume::load(std::shared_ptr<Memfd> memfd, LuksInfo parsed, std::string_view what) {
  init_library();
  last_library_error.clear();
  crypt_device* raw = nullptr;
  if (const int r = crypt_init(&raw, memfd->path().c_str()); r < 0) return library_error(r, what, "crypt_init");
  Device cd(raw);
  const char* type = parsed.version == kLuksVersion1 ? CRYPT_LUKS1 : CRYPT_LUKS2;
  if (const int r = crypt_load(cd.get(), type, nullptr); r < 0)
    return library_error(r, what, "loading the LUKS header");
  fill_from_library(cd.get(), parsed);
  return LuksVolume(std::move(cd), std::move(memfd), std::move(parsed), std::string(what));
}

// [off, off + len) of file into the memfd at the same offset, in pieces (zeros past the file's end).
Task<Status> LuksVolume::copy_in(io::HostFile& file, const Memfd& memfd, uint64_t off, uint64_t len,
                                 std::string_view what) {
  constexpr uint64_t kPiece = 1 << 20;
  std::vector<std::byte> buf(static_cast<size_t>(std::min(len, kPiece)));
  for (uint64_t done = 0; done < len;) {
    std::span<std::byte> piece(buf.data(), static_cast<size_t>(std::min(len - done, kPiece)));
    Status st = co_await read_padded(file, off + done, piece);
    if (!st) co_return st.with_context(fmt::format("{}: reading the LUKS header", what));
    QCOWFS_CO_TRY(memfd.write_at(off + done, piece, what));
    done += piece.size();
  }
  co_return Status::ok();
}

Task<Result<LuksVolume>> LuksVolume::open_file(io::HostFile& file, std::string_view what) {
  const uint64_t size = file.size();
  std::vector<std::byte> head(static_cast<size_t>(std::min<uint64_t>(size, kLuksProbeBytes)));
  if (Status st = co_await read_padded(file, 0, head); !st)
    co_return st.with_context(fmt::format("{}: reading the LUKS header", what));
  auto parsed = parse_luks_header(head, size, what);
  if (!parsed) co_return parsed.status();
  // The memfd has the file's size (sparse), so libcryptsetup's size checks see the image's.
  auto memfd = Memfd::create(size, what);
  if (!memfd) co_return memfd.status();
  // LUKS1: the phdr is inside head; LUKS2: both binary headers and JSON areas (metadata_bytes so far).
  const uint64_t headers = parsed->version == kLuksVersion1 ? head.size() : parsed->metadata_bytes;
  uint64_t copied = headers;
  QCOWFS_CO_TRY(co_await copy_in(file, **memfd, 0, headers, what));
  auto vol = load(std::move(*memfd), std::move(*parsed), what);
  if (!vol) co_return vol.status();
  // Each active slot's material; a slot over the limits stays out (unlock refuses it by name).
  for (const LuksKeySlotInfo& slot : vol->info_.slots) {
    if (!slot.active || !check_slot_key_material(slot, what) || slot.key_offset >= size) continue;
    const uint64_t len = std::min(slot.key_length, size - slot.key_offset);
    copied += len;
    if (copied > kMaxLuksHeaderBytes)
      co_return Status::errorf(EFBIG, "{}: LUKS header and key material of {} bytes exceed the limit of {}", what,
                               copied, kMaxLuksHeaderBytes);
    QCOWFS_CO_TRY(co_await copy_in(file, *vol->memfd_, slot.key_offset, len, what));
  }
  co_return std::move(*vol);
}

Result<LuksVolume> LuksVolume::open_bytes(std::span<const std::byte> area, std::string_view what) {
  if (area.size() > kMaxLuksHeaderBytes)
    return Status::errorf(EFBIG, "{}: LUKS header area of {} bytes exceeds the limit of {}", what, area.size(),
                          kMaxLuksHeaderBytes);
  auto parsed = parse_luks_header(area.first(std::min(area.size(), kLuksProbeBytes)), area.size(), what);
  if (!parsed) return parsed.status();
  auto memfd = Memfd::create(area.size(), what);
  if (!memfd) return memfd.status();
  QCOWFS_TRY((*memfd)->write_at(0, area, what));
  return load(std::move(*memfd), std::move(*parsed), what);
}

Result<std::vector<std::byte>> LuksVolume::header_bytes(uint64_t off, size_t len) const {
  if (!memfd_) return Status::errorf(EINVAL, "{}: no header copy to read", what_);
  return memfd_->read_at(off, len, what_);
}

Result<SecretBuffer> LuksVolume::unlock(std::span<const std::byte> passphrase) const {
  std::vector<int> usable;
  Status refused;
  for (const auto& slot : info_.slots) {
    if (!slot.active) continue;
    if (Status st = check_luks_slot_limits(slot, what_); !st) {
      log::warn("{}", st.message());
      if (refused.is_ok()) refused = st;
      continue;
    }
    usable.push_back(static_cast<int>(slot.index));
  }
  if (usable.empty()) {
    if (!refused.is_ok()) return refused;
    return Status::errorf(ENOKEY, "{}: the LUKS header has no active key slot", what_);
  }
  auto key = SecretBuffer::allocate(info_.key_bytes > 0 ? info_.key_bytes : kLuks1MaxKeyBytes);
  if (!key) return key.status();
  const char* pass = passphrase.empty() ? "" : reinterpret_cast<const char*>(passphrase.data());
  for (int index : usable) {
    size_t size = key->size();
    last_library_error.clear();
    const int r =
        crypt_volume_key_get(cd_.get(), index, reinterpret_cast<char*>(key->data()), &size, pass, passphrase.size());
    if (r >= 0) {
      key->shrink(size);
      return key;
    }
    if (r != -EPERM) return library_error(r, what_, fmt::format("unlocking LUKS key slot {}", index));
  }
  last_library_error.clear();
  if (!refused.is_ok())
    return Status::errorf(EACCES, "wrong passphrase for {} (no key slot accepts it; not tried: {})", what_,
                          refused.message());
  return Status::errorf(EACCES, "wrong passphrase for {} (no key slot accepts it)", what_);
}

// ---- format_luks1 ---------------------------------------------------------------------------------------

namespace {

constexpr std::string_view kFormatWhat = "new LUKS1 header";

Status check_format_params(const LuksFormatParams& p) {
  if (p.key_bytes == 0 || p.key_bytes > kLuks1MaxKeyBytes)
    return Status::errorf(EINVAL, "{}: key length {} bytes is outside 1..{}", kFormatWhat, p.key_bytes,
                          kLuks1MaxKeyBytes);
  if (p.payload_align == 0 || p.payload_align % kLuks1SectorBytes != 0 || p.payload_align > kMaxLuksHeaderBytes)
    return Status::errorf(EINVAL, "{}: payload alignment {} is not a multiple of {} up to {}", kFormatWhat,
                          p.payload_align, kLuks1SectorBytes, kMaxLuksHeaderBytes);
  if (p.iter_time_ms == 0) return Status::errorf(EINVAL, "{}: iter-time must be at least 1 ms", kFormatWhat);
  if (!parse_hash_alg(p.hash)) return Status::errorf(EINVAL, "{}: unknown hash '{}'", kFormatWhat, p.hash);
  auto spec = spec_from_luks(p.cipher_name, p.cipher_mode, p.key_bytes);
  if (!spec) return spec.status().with_context(kFormatWhat);
  return Status::ok();
}

// The memfd's size: the header and eight slots of the largest key, then the alignment (sparse: no cost).
uint64_t format_device_bytes(const LuksFormatParams& p) {
  const uint64_t material = 4096 + kLuks1KeySlots * qemu_split_sectors(p.key_bytes, kLuks1Stripes) * kLuks1SectorBytes;
  return div_round_up(material, p.payload_align) * p.payload_align + p.payload_align;
}

}  // namespace

Result<LuksFormatted> format_luks1(const LuksFormatParams& params, std::span<const std::byte> passphrase) {
  QCOWFS_TRY(check_format_params(params));
  init_library();
  last_library_error.clear();
  auto memfd = LuksVolume::Memfd::create(format_device_bytes(params), kFormatWhat);
  if (!memfd) return memfd.status();
  crypt_device* raw = nullptr;
  if (const int r = crypt_init(&raw, (*memfd)->path().c_str()); r < 0)
    return library_error(r, kFormatWhat, "crypt_init");
  LuksVolume::Device cd(raw);
  crypt_pbkdf_type pbkdf{};
  pbkdf.type = CRYPT_KDF_PBKDF2;
  pbkdf.hash = params.hash.c_str();
  pbkdf.time_ms = params.iter_time_ms;
  if (const int r = crypt_set_pbkdf_type(cd.get(), &pbkdf); r < 0)
    return library_error(r, kFormatWhat, "setting the key derivation");
  crypt_params_luks1 luks1{};
  luks1.hash = params.hash.c_str();
  luks1.data_alignment = params.payload_align / kLuks1SectorBytes;
  if (const int r = crypt_format(cd.get(), CRYPT_LUKS1, params.cipher_name.c_str(), params.cipher_mode.c_str(), nullptr,
                                 nullptr, params.key_bytes, &luks1);
      r < 0)
    return library_error(r, kFormatWhat, "crypt_format");
  auto key = SecretBuffer::allocate(params.key_bytes);
  if (!key) return key.status();
  size_t key_size = key->size();
  if (const int r =
          crypt_volume_key_get(cd.get(), CRYPT_ANY_SLOT, reinterpret_cast<char*>(key->data()), &key_size, nullptr, 0);
      r < 0)
    return library_error(r, kFormatWhat, "reading the new volume key");
  const char* pass = passphrase.empty() ? "" : reinterpret_cast<const char*>(passphrase.data());
  if (const int r = crypt_keyslot_add_by_volume_key(cd.get(), 0, nullptr, 0, pass, passphrase.size()); r < 0)
    return library_error(r, kFormatWhat, "adding key slot 0");
  LuksFormatted out;
  out.payload_offset = crypt_get_data_offset(cd.get()) * kLuks1SectorBytes;
  cd.reset();  // everything written
  auto header = (*memfd)->read_at(0, static_cast<size_t>(out.payload_offset), kFormatWhat);
  if (!header) return header.status();
  out.header = std::move(*header);
  key->shrink(key_size);
  out.volume_key = std::move(*key);
  return out;
}

}  // namespace qcowfs::image::crypto
