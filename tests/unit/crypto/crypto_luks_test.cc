// LUKS headers (crypto/luks.h) against the real tools: images made by qemu-img
// (LUKS1) and cryptsetup (LUKS2), volume keys checked against
// `cryptsetup luksDump --dump-master-key`, headers made by format_luks1 opened
// by cryptsetup and qemu-img, and damaged headers refused with a clear Status.
#include "image/crypto/luks.h"

#include "unit/crypto/crypto_test_util.h"
#include "unit/io/io_test_util.h"
#include "io/mem_file.h"

#include <gcrypt.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace qcowfs::image::crypto {
namespace {

namespace fs = std::filesystem;

constexpr std::string_view kPass = "pw";

std::span<const std::byte> bytes(std::string_view s) { return std::as_bytes(std::span(s.data(), s.size())); }

// ---- Tools and files ------------------------------------------------------------------------------

struct ToolRun {
  int status = -1;
  std::string out;
};

ToolRun run(const std::string& cmd) {
  ToolRun r;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (p == nullptr) return r;
  std::array<char, 4096> buf{};
  size_t n = 0;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  r.status = pclose(p);
  return r;
}

std::string must_run(const std::string& cmd) {
  ToolRun r = run(cmd);
  EXPECT_EQ(r.status, 0) << cmd << "\n" << r.out;
  return r.out;
}

std::vector<std::byte> read_file(const fs::path& p, size_t max = SIZE_MAX) {
  return io::testing::read_file(p.string(), max);
}

// A LUKS image opened as the driver opens it, through a HostFile: here one in memory, which has no
// path for libcryptsetup to open.
Result<LuksVolume> open_image(const fs::path& p, std::string_view what) {
  io::MemFile file(io::MemFileOptions{}, read_file(p));
  return io::testing::run_now(LuksVolume::open_file(file, what));
}

void write_file(const fs::path& p, std::span<const std::byte> data, uint64_t total = 0) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
  out.close();
  if (total > data.size()) fs::resize_file(p, total);
}

void put_be32(std::vector<std::byte>& b, size_t at, uint32_t v) {
  for (int i = 0; i < 4; ++i) b[at + static_cast<size_t>(i)] = std::byte(static_cast<uint8_t>(v >> (24 - 8 * i)));
}

std::string hex(std::span<const std::byte> b) {
  std::string s;
  for (std::byte c : b) s += fmt::format("{:02x}", std::to_integer<unsigned>(c));
  return s;
}

// "Field:   value" lines of luksDump (the first of each name).
std::string dump_field(const std::string& dump, const std::string& name) {
  std::istringstream in(dump);
  std::string line;
  while (std::getline(in, line)) {
    const size_t at = line.find(name + ":");
    if (at == std::string::npos) continue;
    std::string v = line.substr(at + name.size() + 1);
    v.erase(0, v.find_first_not_of(" \t"));
    v.erase(v.find_last_not_of(" \t") + 1);
    return v;
  }
  return {};
}

// The volume key as luksDump --dump-master-key prints it, in hex.
std::string reference_key(const fs::path& img, const fs::path& keyfile) {
  std::string out = must_run(fmt::format("cryptsetup luksDump --dump-master-key --batch-mode --key-file {} {}",
                                         keyfile.string(), img.string()));
  const size_t at = out.find("MK dump:");
  EXPECT_NE(at, std::string::npos) << out;
  std::string h;
  for (size_t i = at + 8; i < out.size(); ++i) {
    const char c = out[i];
    if (std::isxdigit(static_cast<unsigned char>(c)))
      h += c;
    else if (c != ' ' && c != '\t' && c != '\n')
      break;
  }
  return h;
}

class Tmp {
 public:
  Tmp() {
    char tmpl[] = "/tmp/qcowfs-luks-XXXXXX";
    dir_ = mkdtemp(tmpl);
    std::ofstream(dir_ / "pw", std::ios::binary) << kPass;
  }
  ~Tmp() { fs::remove_all(dir_); }
  fs::path operator/(const std::string& n) const { return dir_ / n; }
  fs::path keyfile() const { return dir_ / "pw"; }

 private:
  fs::path dir_;
};

// Images shared by the tests of this file (LUKS2 formatting benchmarks its digest: a few seconds each).
class Images {
 public:
  static Images& get() {
    static Images images;
    return images;
  }
  const Tmp& tmp() const { return tmp_; }

  fs::path qemu_luks1(const std::string& opts = "") {
    const std::string name = "q1" + std::to_string(std::hash<std::string>{}(opts)) + ".luks";
    if (!made_.contains(name)) {
      std::string out;
      const int rc = testing::qemu_img_create_luks((tmp_ / name).string(),
                                                   "key-secret=s0,iter-time=10" + (opts.empty() ? "" : "," + opts), &out,
                                                   "4M");
      if (rc != 0) ADD_FAILURE() << out;
      must_run("test -s " + (tmp_ / name).string());
      made_[name] = true;
    }
    return tmp_ / name;
  }
  fs::path luks2(const std::string& args) {
    const std::string name = "c2" + std::to_string(std::hash<std::string>{}(args)) + ".img";
    if (!made_.contains(name)) {
      const fs::path p = tmp_ / name;
      must_run("truncate -s 17M " + p.string());
      // Fixed KDF costs (cryptsetup's minimums: 1000 PBKDF2 iterations, 4 Argon2
      // passes) instead of --iter-time, whose benchmark costs 2-3 s of CPU per image.
      const char* iterations = args.find("pbkdf2") != std::string::npos ? "1000" : "4";
      must_run(fmt::format("cryptsetup luksFormat --type luks2 --batch-mode --pbkdf-force-iterations {} {} --key-file {} {}",
                           iterations, args, tmp_.keyfile().string(), p.string()));
      made_[name] = true;
    }
    return tmp_ / name;
  }

 private:
  Tmp tmp_;
  std::map<std::string, bool> made_;
};

constexpr const char* kArgon2 = "--pbkdf argon2id --pbkdf-memory 1024";

// ---- LUKS1 made by qemu-img --------------------------------------------------------------------------

void expect_luks1_matches_dump(const LuksInfo& info, const fs::path& img) {
  const std::string dump = must_run("cryptsetup luksDump " + img.string());
  EXPECT_EQ(info.version, 1);
  EXPECT_EQ(info.cipher_name, dump_field(dump, "Cipher name"));
  EXPECT_EQ(info.cipher_mode, dump_field(dump, "Cipher mode"));
  EXPECT_EQ(info.hash, dump_field(dump, "Hash spec"));
  EXPECT_EQ(std::to_string(info.key_bytes * 8), dump_field(dump, "MK bits"));
  EXPECT_EQ(std::to_string(info.payload_offset / 512), dump_field(dump, "Payload offset"));
  EXPECT_EQ(std::to_string(info.master_key_iterations), dump_field(dump, "MK iterations"));
  EXPECT_EQ(info.sector_size, 512u);
  EXPECT_EQ(info.uuid + "\n", must_run("cryptsetup luksUUID " + img.string()));
  ASSERT_EQ(info.slots.size(), 8u);
  EXPECT_TRUE(info.slots[0].active);
  EXPECT_EQ(std::to_string(info.slots[0].iterations), dump_field(dump, "Iterations"));
  EXPECT_EQ(std::to_string(info.slots[0].key_offset / 512), dump_field(dump, "Key material offset"));
  EXPECT_EQ(std::to_string(info.slots[0].stripes), dump_field(dump, "AF stripes"));
  EXPECT_EQ(info.slots[0].pbkdf, "pbkdf2");
  EXPECT_EQ(info.slots[0].hash, info.hash);
  EXPECT_EQ(info.slots[0].key_length, (info.key_bytes * 4000 + 511) / 512 * 512);
  for (unsigned i = 1; i < 8; ++i) EXPECT_FALSE(info.slots[i].active) << i;
  EXPECT_LE(info.metadata_bytes, info.payload_offset);
  EXPECT_GT(info.metadata_bytes, info.slots[7].key_offset);
}

class QemuLuks1 : public ::testing::TestWithParam<std::string> {};

TEST_P(QemuLuks1, UnlocksTheKeyLuksDumpShowsAndReportsItsHeader) {
  auto& im = Images::get();
  const fs::path img = im.qemu_luks1(GetParam());
  auto v = open_image(img, "q.luks");
  ASSERT_TRUE(v) << v.status().to_string();
  expect_luks1_matches_dump(v->info(), img);
  // The pure parser agrees with libcryptsetup's view.
  auto parsed = parse_luks_header(read_file(img, 4096), fs::file_size(img), "q.luks");
  ASSERT_TRUE(parsed) << parsed.status().to_string();
  EXPECT_EQ(parsed->cipher_mode, v->info().cipher_mode);
  EXPECT_EQ(parsed->payload_offset, v->info().payload_offset);
  EXPECT_EQ(parsed->slots[0].key_offset, v->info().slots[0].key_offset);
  EXPECT_EQ(parsed->slots[0].key_length, v->info().slots[0].key_length);
  auto key = v->unlock(bytes(kPass));
  const ToolRun ref = run(fmt::format("cryptsetup luksDump --dump-master-key --batch-mode --key-file {} {}",
                                      im.tmp().keyfile().string(), img.string()));
  ASSERT_TRUE(key) << key.status().to_string();
  EXPECT_EQ(hex(key->span()), reference_key(img, im.tmp().keyfile()));
}

INSTANTIATE_TEST_SUITE_P(
    Ciphers, QemuLuks1,
    ::testing::Values("", "cipher-alg=aes-128,cipher-mode=cbc,ivgen-alg=essiv,ivgen-hash-alg=sha256,hash-alg=sha512",
                      "cipher-alg=aes-256,cipher-mode=ctr,ivgen-alg=plain64,hash-alg=sha384"));
// Serpent, Twofish and CAST5 key slots: libcryptsetup decrypts key slots with
// OpenSSL (AES only), the kernel's AF_ALG or a dm-crypt mapping, and this
// kernel has neither of the last two, so libcryptsetup (and cryptsetup itself)
// cannot unlock them here. crypto_luks1_test.cc unlocks them through the
// libgcrypt path (crypto/unlock.h falls back to it) and checks the key
// against qemu-io's data.

TEST(CryptoLuks, WrongPassphraseIsEacces) {
  auto v = open_image(Images::get().qemu_luks1(), "q.luks");
  ASSERT_TRUE(v) << v.status().to_string();
  auto key = v->unlock(bytes("not it"));
  ASSERT_FALSE(key);
  EXPECT_EQ(key.status().code(), EACCES);
  EXPECT_NE(key.status().message().find("wrong passphrase for q.luks (no key slot accepts it)"), std::string::npos)
      << key.status().message();
  EXPECT_EQ(v->unlock({}).status().code(), EACCES);
}

TEST(CryptoLuks, OpenBytesOnTheLuks1AreaUnlocksTheSameKey) {
  auto& im = Images::get();
  const fs::path img = im.qemu_luks1();
  auto v = open_image(img, "q.luks");
  ASSERT_TRUE(v) << v.status().to_string();
  const auto area = read_file(img, v->info().payload_offset);
  auto m = LuksVolume::open_bytes(area, "area");
  ASSERT_TRUE(m) << m.status().to_string();
  EXPECT_EQ(m->info().uuid, v->info().uuid);
  EXPECT_EQ(m->info().slots.size(), 8u);
  auto key = m->unlock(bytes(kPass));
  ASSERT_TRUE(key) << key.status().to_string();
  EXPECT_EQ(hex(key->span()), reference_key(img, im.tmp().keyfile()));
}

// ---- LUKS2 made by cryptsetup ---------------------------------------------------------------------------

void expect_luks2_matches_dump(const LuksInfo& info, const fs::path& img) {
  const std::string dump = must_run("cryptsetup luksDump " + img.string());
  EXPECT_EQ(info.version, 2);
  EXPECT_EQ(info.cipher_name, "aes");
  EXPECT_EQ(info.cipher_mode, "xts-plain64");
  EXPECT_EQ(info.key_bytes, 64u);
  EXPECT_EQ(info.hash, "sha256");
  EXPECT_EQ(info.uuid, dump_field(dump, "UUID"));
  EXPECT_EQ(info.uuid + "\n", must_run("cryptsetup luksUUID " + img.string()));
  EXPECT_EQ(fmt::format("{} [bytes]", info.payload_offset), dump_field(dump, "offset"));
  EXPECT_EQ(fmt::format("{} [bytes]", info.sector_size), dump_field(dump, "sector"));
  EXPECT_EQ(info.master_key_iterations, 0u);
  ASSERT_EQ(info.slots.size(), 1u);
  const auto& s = info.slots[0];
  EXPECT_TRUE(s.active);
  EXPECT_EQ(s.pbkdf, dump_field(dump, "PBKDF"));
  EXPECT_EQ(std::to_string(s.stripes), dump_field(dump, "AF stripes"));
  EXPECT_EQ(fmt::format("{} [bytes]", s.key_offset), dump_field(dump, "Area offset"));
  EXPECT_EQ(fmt::format("{} [bytes]", s.key_length), dump_field(dump, "Area length"));
  if (s.pbkdf == "pbkdf2") {
    EXPECT_EQ(std::to_string(s.iterations), dump_field(dump, "Iterations"));
    EXPECT_EQ(s.hash, dump_field(dump, "Hash"));
  } else {
    EXPECT_EQ(std::to_string(s.iterations), dump_field(dump, "Time cost"));
    EXPECT_EQ(std::to_string(s.memory_kib), dump_field(dump, "Memory"));
    EXPECT_EQ(std::to_string(s.parallel), dump_field(dump, "Threads"));
  }
  EXPECT_GE(info.metadata_bytes, s.key_offset + s.key_length);
  EXPECT_LE(info.metadata_bytes, info.payload_offset);
}

struct Luks2Case {
  const char* args;
  uint32_t sector_size;
};

class CryptsetupLuks2 : public ::testing::TestWithParam<Luks2Case> {};

TEST_P(CryptsetupLuks2, UnlocksTheKeyLuksDumpShowsAndReportsItsHeader) {
  auto& im = Images::get();
  const fs::path img = im.luks2(GetParam().args);
  auto v = open_image(img, "c.img");
  ASSERT_TRUE(v) << v.status().to_string();
  expect_luks2_matches_dump(v->info(), img);
  EXPECT_EQ(v->info().sector_size, GetParam().sector_size);
  auto key = v->unlock(bytes(kPass));
  ASSERT_TRUE(key) << key.status().to_string();
  EXPECT_EQ(hex(key->span()), reference_key(img, im.tmp().keyfile()));
  auto wrong = v->unlock(bytes("nope"));
  EXPECT_EQ(wrong.status().code(), EACCES) << wrong.status().to_string();
  // The whole header area in memory (a detached header) unlocks the same.
  auto m = LuksVolume::open_bytes(read_file(img, v->info().metadata_bytes), "area");
  ASSERT_TRUE(m) << m.status().to_string();
  auto key2 = m->unlock(bytes(kPass));
  ASSERT_TRUE(key2) << key2.status().to_string();
  EXPECT_EQ(hex(key2->span()), hex(key->span()));
}

INSTANTIATE_TEST_SUITE_P(Kdfs, CryptsetupLuks2,
                         ::testing::Values(Luks2Case{kArgon2, 4096}, Luks2Case{"--pbkdf pbkdf2 --sector-size 512", 512},
                                           Luks2Case{"--pbkdf pbkdf2 --sector-size 4096", 4096}));

// ---- format_luks1 ----------------------------------------------------------------------------------------

TEST(CryptoLuks, FormatLuks1IsReadByCryptsetupQemuAndOurselves) {
  auto& im = Images::get();
  LuksFormatParams params;
  params.iter_time_ms = 10;
  auto f = format_luks1(params, bytes(kPass));
  ASSERT_TRUE(f) << f.status().to_string();
  EXPECT_EQ(f->header.size(), f->payload_offset);
  EXPECT_EQ(f->payload_offset % 4096, 0u);
  EXPECT_EQ(f->volume_key.size(), 64u);
  const fs::path img = im.tmp() / "formatted.luks";
  write_file(img, f->header, f->payload_offset + (1 << 20));
  const std::string dump = must_run("cryptsetup luksDump " + img.string());
  EXPECT_EQ(dump_field(dump, "Version"), "1");
  EXPECT_EQ(dump_field(dump, "Key Slot 0"), "ENABLED");
  EXPECT_EQ(reference_key(img, im.tmp().keyfile()), hex(f->volume_key.span()));
  must_run(
      fmt::format("qemu-io --object secret,id=s0,data={} --image-opts "
                  "driver=luks,key-secret=s0,file.filename={} -c 'read 0 512'",
                  kPass, img.string()));
  auto v = LuksVolume::open_bytes(f->header, "formatted");
  ASSERT_TRUE(v) << v.status().to_string();
  EXPECT_EQ(v->info().payload_offset, f->payload_offset);
  auto key = v->unlock(bytes(kPass));
  ASSERT_TRUE(key) << key.status().to_string();
  EXPECT_EQ(hex(key->span()), hex(f->volume_key.span()));
}

TEST(CryptoLuks, FormatLuks1TakesQemuCipherChoices) {
  LuksFormatParams params;
  params.cipher_mode = "cbc-essiv:sha256";
  params.key_bytes = 16;
  params.hash = "sha1";
  params.iter_time_ms = 10;
  params.payload_align = 1 << 20;
  auto f = format_luks1(params, bytes(kPass));
  ASSERT_TRUE(f) << f.status().to_string();
  EXPECT_EQ(f->payload_offset, 1u << 20);
  auto v = LuksVolume::open_bytes(f->header, "formatted");
  ASSERT_TRUE(v) << v.status().to_string();
  EXPECT_EQ(v->info().cipher_mode, "cbc-essiv:sha256");
  EXPECT_EQ(v->info().hash, "sha1");
  EXPECT_EQ(v->info().key_bytes, 16u);
  auto key = v->unlock(bytes(kPass));
  ASSERT_TRUE(key) << key.status().to_string();
  EXPECT_EQ(hex(key->span()), hex(f->volume_key.span()));
}

TEST(CryptoLuks, FormatLuks1RefusesBadParameters) {
  LuksFormatParams params;
  params.cipher_name = "foo";
  EXPECT_EQ(format_luks1(params, bytes(kPass)).status().code(), EINVAL);
  params = {};
  params.key_bytes = 1000;
  EXPECT_EQ(format_luks1(params, bytes(kPass)).status().code(), EINVAL);
  params = {};
  params.payload_align = 1000;
  EXPECT_EQ(format_luks1(params, bytes(kPass)).status().code(), EINVAL);
}

// ---- Hostile headers -------------------------------------------------------------------------------------

// LUKS1 phdr offsets (big-endian): see crypto/luks.cc.
constexpr size_t kCipherName = 8, kPayloadOffset = 104, kKeyBytes = 108, kMkIterations = 164, kSlots = 208,
                 kSlotSize = 48;
constexpr size_t kSlotIterations = 4, kSlotKeyOffset = 40, kSlotStripes = 44;

class HostileLuks1 : public ::testing::Test {
 protected:
  void SetUp() override {
    img_ = Images::get().qemu_luks1();
    bytes_ = read_file(img_);
  }
  // Writes the patched image and opens it; the Status must carry err and text.
  void expect_refused_at_open(int err, const std::string& text) {
    const fs::path p = Images::get().tmp() / "hostile.luks";
    write_file(p, bytes_);
    auto v = open_image(p, "hostile.luks");
    ASSERT_FALSE(v) << "opened";
    EXPECT_EQ(v.status().code(), err) << v.status().to_string();
    EXPECT_NE(v.status().message().find(text), std::string::npos) << v.status().message();
    EXPECT_NE(v.status().message().find("hostile.luks"), std::string::npos) << v.status().message();
    auto m = LuksVolume::open_bytes(std::span(bytes_).first(std::min<size_t>(bytes_.size(), 4 << 20)), "area");
    EXPECT_FALSE(m);
  }
  size_t slot(unsigned i, size_t field) const { return kSlots + i * kSlotSize + field; }
  fs::path img_;
  std::vector<std::byte> bytes_;
};

TEST_F(HostileLuks1, HugeSlotIterationsAreRefusedBeforeDerivation) {
  put_be32(bytes_, slot(0, kSlotIterations), 0xFFFFFFFF);
  const fs::path p = Images::get().tmp() / "iter.luks";
  write_file(p, bytes_);
  auto v = open_image(p, "iter.luks");
  ASSERT_TRUE(v) << v.status().to_string();  // the header is readable; the slot is not usable
  EXPECT_EQ(v->info().slots[0].iterations, 0xFFFFFFFFu);
  const auto start = std::chrono::steady_clock::now();
  auto key = v->unlock(bytes(kPass));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
  ASSERT_FALSE(key);
  EXPECT_EQ(key.status().code(), EINVAL);
  EXPECT_NE(key.status().message().find("key slot 0: pbkdf2 iterations 4294967295 exceeds the limit of 67108864"),
            std::string::npos)
      << key.status().message();
}

TEST_F(HostileLuks1, ASlotOverTheLimitIsSkippedAndTheOthersStillUnlock) {
  // Slot 1 gets a second passphrase; slot 0's iterations are then pushed over the limit.
  const fs::path p = Images::get().tmp() / "two-slots.luks";
  write_file(p, bytes_);
  const fs::path pw2 = Images::get().tmp() / "pw2";
  std::ofstream(pw2, std::ios::binary) << "second";
  must_run(
      fmt::format("cryptsetup luksAddKey --batch-mode --disable-locks --pbkdf-force-iterations 1000 --key-slot 1 --key-file {} {} {}",
                  Images::get().tmp().keyfile().string(), p.string(), pw2.string()));
  auto b = read_file(p);
  put_be32(b, slot(0, kSlotIterations), kMaxPbkdf2Iterations + 1);
  write_file(p, b);
  auto v = open_image(p, "two-slots.luks");
  ASSERT_TRUE(v) << v.status().to_string();
  EXPECT_TRUE(v->info().slots[1].active);
  auto key = v->unlock(bytes("second"));
  ASSERT_TRUE(key) << key.status().to_string();
  EXPECT_EQ(hex(key->span()), reference_key(img_, Images::get().tmp().keyfile()));
  // The first passphrase's slot is not tried: a wrong-passphrase answer that says why.
  auto first = v->unlock(bytes(kPass));
  ASSERT_FALSE(first);
  EXPECT_EQ(first.status().code(), EACCES);
  EXPECT_NE(first.status().message().find("not tried: two-slots.luks: LUKS key slot 0: pbkdf2 iterations 67108865 "
                                          "exceeds the limit of 67108864"),
            std::string::npos)
      << first.status().message();
}

TEST_F(HostileLuks1, HugeMasterKeyIterations) {
  put_be32(bytes_, kMkIterations, 0xFFFFFFFF);
  expect_refused_at_open(EINVAL, "master key digest iterations 4294967295 (expected 1 to 67108864)");
}

TEST_F(HostileLuks1, ZeroSlotIterations) {
  put_be32(bytes_, slot(0, kSlotIterations), 0);
  expect_refused_at_open(EINVAL, "key slot 0 has 0 iterations");
}

TEST_F(HostileLuks1, KeyOffsetPastTheFile) {
  put_be32(bytes_, kPayloadOffset, 0x7FFFFFFF);
  put_be32(bytes_, slot(0, kSlotKeyOffset), 0x10000000);
  expect_refused_at_open(EINVAL, "key slot 0 key material (sectors 268435456 to 268435955) lies past the end");
}

TEST_F(HostileLuks1, KeyMaterialOverlappingThePayload) {
  put_be32(bytes_, slot(7, kSlotKeyOffset), 4000);
  expect_refused_at_open(EINVAL, "key slot 7 key material (sectors 4000 to 4499) overlaps the payload at sector 4040");
}

TEST_F(HostileLuks1, KeyMaterialOverlappingTheHeader) {
  put_be32(bytes_, slot(0, kSlotKeyOffset), 1);
  expect_refused_at_open(EINVAL, "key slot 0 key material at sector 1 overlaps the header");
}

TEST_F(HostileLuks1, ZeroStripes) {
  put_be32(bytes_, slot(2, kSlotStripes), 0);
  expect_refused_at_open(EINVAL, "key slot 2 has 0 stripes (expected 1 to 65536)");
}

TEST_F(HostileLuks1, HugeStripes) {
  put_be32(bytes_, slot(0, kSlotStripes), 0xFFFFFFFF);
  expect_refused_at_open(EINVAL, "key slot 0 has 4294967295 stripes");
}

TEST_F(HostileLuks1, OverlappingSlots) {
  put_be32(bytes_, slot(3, kSlotKeyOffset), 0x200 + 8);
  expect_refused_at_open(EINVAL, "key slots 1 and 3 overlap");
}

TEST_F(HostileLuks1, BadSlotState) {
  put_be32(bytes_, slot(5, 0), 0x12345678);
  expect_refused_at_open(EINVAL, "key slot 5 state 0x12345678 is neither enabled nor disabled");
}

TEST_F(HostileLuks1, UnknownCipher) {
  std::memcpy(bytes_.data() + kCipherName, "foo\0", 4);
  expect_refused_at_open(EINVAL, "unknown LUKS cipher 'foo'");
}

TEST_F(HostileLuks1, UnterminatedCipherName) {
  std::memset(bytes_.data() + kCipherName, 'a', 32);
  expect_refused_at_open(EINVAL, "cipher name is not NUL-terminated");
}

TEST_F(HostileLuks1, ZeroKeyBytes) {
  put_be32(bytes_, kKeyBytes, 0);
  expect_refused_at_open(EINVAL, "LUKS1 key of 0 bytes (expected 1 to 512)");
}

TEST_F(HostileLuks1, HugeKeyBytes) {
  put_be32(bytes_, kKeyBytes, 1000);
  expect_refused_at_open(EINVAL, "LUKS1 key of 1000 bytes (expected 1 to 512)");
}

TEST_F(HostileLuks1, KeyBytesNotFittingTheCipher) {
  put_be32(bytes_, kKeyBytes, 40);  // xts with two 20-byte AES keys
  expect_refused_at_open(EINVAL, "unknown LUKS cipher 'aes' with a 40-byte key");
}

TEST_F(HostileLuks1, TruncatedAt100Bytes) {
  bytes_.resize(100);
  expect_refused_at_open(EINVAL, "LUKS1 header truncated (100 bytes, needs 592)");
}

TEST_F(HostileLuks1, KeyMaterialPastTheArea) {
  // The LUKS area of a qcow2 image cut short: slot 0's material does not fit.
  auto m = LuksVolume::open_bytes(std::span(bytes_).first(100000), "area");
  ASSERT_FALSE(m);
  EXPECT_EQ(m.status().code(), EINVAL);
  EXPECT_NE(m.status().message().find("lies past the end (100000 bytes)"), std::string::npos)
      << m.status().message();
}

TEST_F(HostileLuks1, UnknownVersionAndNotLuks) {
  bytes_[7] = std::byte{3};
  expect_refused_at_open(ENOTSUP, "LUKS version 3 is not supported");
  bytes_[0] = std::byte{'X'};
  expect_refused_at_open(EINVAL, "not a LUKS header");
}

// ---- Hostile LUKS2 ------------------------------------------------------------------------------------

// Recomputes the sha256 checksum of the LUKS2 header copy at offset at (hdr_size bytes, csum zeroed).
void fix_luks2_checksum(std::vector<std::byte>& b, size_t at, size_t hdr_size) {
  ASSERT_NE(gcry_check_version(nullptr), nullptr);
  std::memset(b.data() + at + 448, 0, 64);
  std::array<unsigned char, 32> digest{};
  gcry_md_hash_buffer(GCRY_MD_SHA256, digest.data(), b.data() + at, hdr_size);
  std::memcpy(b.data() + at + 448, digest.data(), digest.size());
}

// Replaces from with to in the JSON of both header copies and fixes their checksums.
void patch_luks2_json(std::vector<std::byte>& b, const std::string& from, const std::string& to) {
  const size_t hdr_size = 16384;  // cryptsetup's default
  for (size_t at : {size_t{0}, hdr_size}) {
    std::string json(reinterpret_cast<const char*>(b.data() + at + 4096), hdr_size - 4096);
    const size_t pos = json.find(from);
    ASSERT_NE(pos, std::string::npos) << from;
    json.replace(pos, from.size(), to);
    json.resize(hdr_size - 4096, '\0');
    std::memcpy(b.data() + at + 4096, json.data(), json.size());
    fix_luks2_checksum(b, at, hdr_size);
  }
}

TEST(HostileLuks2, Argon2MemoryAboveTheLimitIsRefusedBeforeDerivation) {
  auto& im = Images::get();
  auto b = read_file(im.luks2(kArgon2));
  patch_luks2_json(b, "\"memory\":1024", "\"memory\":4194305");
  const fs::path p = im.tmp() / "argon.img";
  write_file(p, b);
  auto v = open_image(p, "argon.img");
  ASSERT_TRUE(v) << v.status().to_string();
  ASSERT_EQ(v->info().slots.size(), 1u);
  EXPECT_EQ(v->info().slots[0].memory_kib, 4194305u);
  const auto start = std::chrono::steady_clock::now();
  auto key = v->unlock(bytes(kPass));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
  ASSERT_FALSE(key);
  EXPECT_EQ(key.status().code(), EINVAL);
  EXPECT_NE(key.status().message().find("key slot 0: argon2id memory (KiB) 4194305 exceeds the limit of 4194304"),
            std::string::npos)
      << key.status().message();
}

TEST(HostileLuks2, Argon2TimeCostAndThreadsAboveTheLimit) {
  auto& im = Images::get();
  const auto orig = read_file(im.luks2(kArgon2));
  const fs::path p = im.tmp() / "argon2.img";
  auto b = orig;
  const std::string dump = must_run("cryptsetup luksDump " + im.luks2(kArgon2).string());
  patch_luks2_json(b, "\"time\":" + dump_field(dump, "Time cost"), "\"time\":100000");
  write_file(p, b);
  auto v = open_image(p, "argon2.img");
  ASSERT_TRUE(v) << v.status().to_string();
  auto key = v->unlock(bytes(kPass));
  EXPECT_EQ(key.status().code(), EINVAL);
  EXPECT_NE(key.status().message().find("time cost 100000 exceeds the limit of 1000"), std::string::npos)
      << key.status().message();
  b = orig;
  patch_luks2_json(b, "\"cpus\":" + dump_field(dump, "Threads"), "\"cpus\":64");
  write_file(p, b);
  auto w = open_image(p, "argon2.img");
  ASSERT_TRUE(w) << w.status().to_string();
  key = w->unlock(bytes(kPass));
  EXPECT_EQ(key.status().code(), EINVAL);
  EXPECT_NE(key.status().message().find("parallel threads 64 exceeds the limit of 16"), std::string::npos)
      << key.status().message();
}

TEST(HostileLuks2, BadBinaryHeaders) {
  auto& im = Images::get();
  const auto orig = read_file(im.luks2(kArgon2), 64 << 10);
  auto expect = [](std::span<const std::byte> b, uint64_t avail, int err, const std::string& text) {
    auto r = parse_luks_header(b, avail, "l2");
    ASSERT_FALSE(r);
    EXPECT_EQ(r.status().code(), err) << r.status().to_string();
    EXPECT_NE(r.status().message().find(text), std::string::npos) << r.status().message();
  };
  auto ok = parse_luks_header(orig, 17 << 20, "l2");
  ASSERT_TRUE(ok) << ok.status().to_string();
  EXPECT_EQ(ok->version, 2);
  EXPECT_EQ(ok->uuid.size(), 36u);
  expect(std::span(orig).first(1000), 17 << 20, EINVAL, "truncated LUKS2 header (1000 of 4096 bytes)");
  expect(orig, 8192, EINVAL, "LUKS2 header size 16384 is past the end");
  auto b = orig;
  b[8 + 5] = std::byte{0x50};  // hdr_size 0x5000...: not a power of two
  expect(b, 17 << 20, EINVAL, "is not a power of two");
  b = orig;
  std::memset(b.data() + 72, 'x', 32);
  expect(b, 17 << 20, EINVAL, "checksum algorithm is missing or not NUL-terminated");
  b = orig;
  std::memset(b.data() + 168, 'x', 40);
  expect(b, 17 << 20, EINVAL, "uuid is not NUL-terminated");
  // A damaged checksum passes our bounds checks and is refused by libcryptsetup.
  auto full = read_file(im.luks2(kArgon2), 1 << 20);
  full[4096 + 10] = std::byte{'X'};
  full[16384 + 4096 + 10] = std::byte{'X'};
  auto v = LuksVolume::open_bytes(full, "damaged");
  ASSERT_FALSE(v);
  EXPECT_NE(v.status().message().find("damaged"), std::string::npos) << v.status().message();
}

TEST(CryptoLuks, OpenBytesRefusesAreasAboveTheLimit) {
  std::vector<std::byte> big(kMaxLuksHeaderBytes + 1);
  auto v = LuksVolume::open_bytes(big, "big");
  EXPECT_EQ(v.status().code(), EFBIG);
  EXPECT_NE(v.status().message().find("exceeds the limit of"), std::string::npos);
}

TEST(CryptoLuks, SlotLimits) {
  LuksKeySlotInfo s;
  s.index = 3;
  s.pbkdf = "scrypt";
  EXPECT_EQ(check_luks_slot_limits(s, "x").code(), EINVAL);
  s.pbkdf = "pbkdf2";
  s.iterations = kMaxPbkdf2Iterations;
  EXPECT_TRUE(check_luks_slot_limits(s, "x").is_ok());
  s.iterations = kMaxPbkdf2Iterations + 1;
  EXPECT_NE(check_luks_slot_limits(s, "x").message().find("key slot 3: pbkdf2 iterations"), std::string::npos);
  s.pbkdf = "argon2i";
  s.iterations = 4;
  s.memory_kib = kMaxArgon2MemoryKiB;
  s.parallel = kMaxArgon2Parallel;
  EXPECT_TRUE(check_luks_slot_limits(s, "x").is_ok());
  s.key_length = kMaxLuksHeaderBytes + 1;
  EXPECT_EQ(check_luks_slot_limits(s, "x").code(), EINVAL);
}

}  // namespace
}  // namespace qcowfs::image::crypto
