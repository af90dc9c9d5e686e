// LUKS1 key slots unlocked through libgcrypt against QEMU and cryptsetup:
// images made by qemu-img (one per cipher family, mode, IV generator and hash)
// are unlocked here; the volume key must be cryptsetup's (`luksDump
// --dump-master-key`, AES only: cryptsetup's OpenSSL backend has nothing else
// on this host) and must decrypt the pattern qemu-io wrote (every cipher). A
// second slot added by cryptsetup checks slot order and that key material IVs
// count from the slot's first sector. Damaged headers must be refused with
// EINVAL before any key derivation.
#include "image/crypto/luks1.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include "unit/crypto/crypto_test_util.h"
#include "image/crypto/cipher.h"
#include "unit/io/io_test_util.h"

namespace qcowfs::image::crypto {
namespace {

using io::testing::run_command;
using io::testing::TempFile;
using testing::dump_luks;
using testing::qemu_img_create_luks;
using testing::read_file;

std::span<const std::byte> bytes_of(std::string_view s) { return std::as_bytes(std::span(s.data(), s.size())); }

// Reads from an image held in memory; EIO past its end.
ReadBytesFn reader_of(const std::vector<std::byte> &file) {
  return [&file](uint64_t offset, size_t length) -> Result<std::vector<std::byte>> {
    if (offset > file.size() || length > file.size() - offset)
      return Status::errorf(EIO, "read past the end at {:#x}", offset);
    const auto at = file.begin() + static_cast<long>(offset);
    return std::vector<std::byte>(at, at + static_cast<long>(length));
  };
}

// A LUKS image by qemu-img with the passphrase "pw" in a file beside it.
struct QemuImage {
  TempFile image{"luks1_img"};
  TempFile pass{"luks1_pass"};

  ::testing::AssertionResult create(const std::string &opts) {
    { std::ofstream(pass.path()) << "pw"; }
    std::string out;
    if (qemu_img_create_luks(image.path(), "key-secret=s0,iter-time=10," + opts, &out) != 0)
      return ::testing::AssertionFailure() << "qemu-img: " << out;
    if (run_command(fmt::format("qemu-io --object secret,id=s0,data=pw "
                                "--image-opts driver=luks,key-secret=s0,"
                                "file.filename={} -c 'write -P 0x5a 0 4096'",
                                image.path()),
                    &out) != 0)
      return ::testing::AssertionFailure() << "qemu-io: " << out;
    return ::testing::AssertionSuccess();
  }
};

// The payload's first 4096 bytes decrypted with key: qemu-io's 0x5a pattern.
void expect_pattern(const std::vector<std::byte> &file, const Luks1Header &h, const SecretBuffer &key) {
  auto spec = spec_from_luks(h.cipher_name, h.cipher_mode, h.key_bytes);
  ASSERT_TRUE(spec) << spec.status().to_string();
  auto cipher = SectorCipher::create(*spec, key.span());
  ASSERT_TRUE(cipher) << cipher.status().to_string();
  ASSERT_GE(file.size(), h.payload_bytes() + 4096);
  const auto at = file.begin() + static_cast<long>(h.payload_bytes());
  std::vector<std::byte> buf(at, at + 4096);
  ASSERT_TRUE((*cipher)->decrypt(0, buf));
  for (size_t i = 0; i < buf.size(); ++i) ASSERT_EQ(buf[i], std::byte{0x5a}) << "payload byte " << i;
}

std::vector<std::byte> to_vector(const SecretBuffer &b) { return {b.span().begin(), b.span().end()}; }

struct Combo {
  const char *alg;
  const char *mode;
  const char *ivgen;
  const char *ivhash;  // essiv only
  const char *hash;    // hash-alg (PBKDF2 and AF); "": sha512, what qemu_img_create_luks adds
  const char *luks_mode;
};

void PrintTo(const Combo &c, std::ostream *os) {
  *os << c.alg << " " << c.luks_mode << " " << (*c.hash ? c.hash : "sha512");
}

class CryptoLuks1Qemu : public ::testing::TestWithParam<Combo> {};

TEST_P(CryptoLuks1Qemu, UnlocksTheVolumeKeyQemuWrote) {
  const Combo c = GetParam();
  std::string opts = fmt::format("cipher-alg={},cipher-mode={},ivgen-alg={}", c.alg, c.mode, c.ivgen);
  if (*c.ivhash) opts += fmt::format(",ivgen-hash-alg={}", c.ivhash);
  if (*c.hash) opts += fmt::format(",hash-alg={}", c.hash);
  QemuImage img;
  ASSERT_TRUE(img.create(opts));
  const std::vector<std::byte> file = read_file(img.image.path());
  auto h = parse_luks1(file, file.size(), img.image.path());
  ASSERT_TRUE(h) << h.status().to_string();
  EXPECT_EQ(h->cipher_mode, c.luks_mode);
  EXPECT_EQ(h->hash_spec, *c.hash ? c.hash : "sha512");
  EXPECT_EQ(name_of(h->spec.alg), c.alg);

  const auto start = std::chrono::steady_clock::now();
  auto key = unlock_luks1(*h, bytes_of("pw"), reader_of(file), "img");
  ASSERT_TRUE(key) << key.status().to_string();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  ASSERT_EQ(key->size(), h->key_bytes);
  expect_pattern(file, *h, *key);
  if (std::string_view(c.alg).starts_with("aes-") && std::string_view(c.alg) != "aes-192") {
    const testing::Dump d = dump_luks(img.image.path(), img.pass.path());
    EXPECT_EQ(to_vector(*key), d.key) << "cryptsetup's volume key differs";
    EXPECT_EQ(h->payload_bytes(), d.payload_offset);
  }

  auto wrong = unlock_luks1(*h, bytes_of("pW"), reader_of(file), "img");
  EXPECT_EQ(wrong.status().code(), EACCES);
  EXPECT_EQ(wrong.status().message(), "wrong passphrase for img (no key slot accepts it)");
}

INSTANTIATE_TEST_SUITE_P(CryptoLuks1Images, CryptoLuks1Qemu,
                         // aes-256-xts-plain64 with sha256 is CryptoLuks1Hostile's image.
                         ::testing::Values(Combo{"aes-128", "cbc", "essiv", "sha256", "ripemd160", "cbc-essiv:sha256"},
                                           Combo{"serpent-256", "xts", "plain64", "", "sha512", "xts-plain64"},
                                           Combo{"twofish-128", "cbc", "essiv", "sha256", "", "cbc-essiv:sha256"},
                                           Combo{"cast5-128", "cbc", "plain64", "", "", "cbc-plain64"},
                                           Combo{"aes-192", "xts", "plain64", "", "", "xts-plain64"}),
                         [](const ::testing::TestParamInfo<Combo> &i) {
                           std::string n = fmt::format("{}_{}_{}{}_{}", i.param.alg, i.param.mode, i.param.ivgen,
                                                       i.param.ivhash, *i.param.hash ? i.param.hash : "sha512");
                           for (char &ch : n)
                             if (ch == '-') ch = '_';
                           return n;
                         });

// One aes-256-xts-plain64 image (sha256) made for the suite: the base of the
// second-slot test and of the damaged headers.
class CryptoLuks1Hostile : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    image_ = new QemuImage;
    ::testing::AssertionResult made = image_->create("cipher-alg=aes-256,cipher-mode=xts,ivgen-alg=plain64");
    if (made)
      file_ = new std::vector<std::byte>(read_file(image_->image.path()));
    else
      ADD_FAILURE() << made.message();
  }
  static void TearDownTestSuite() {
    delete file_;
    delete image_;
    file_ = nullptr;
    image_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(file_, nullptr) << "no image"; }

  static QemuImage *image_;
  static std::vector<std::byte> *file_;
};
QemuImage *CryptoLuks1Hostile::image_ = nullptr;
std::vector<std::byte> *CryptoLuks1Hostile::file_ = nullptr;

TEST_F(CryptoLuks1Hostile, SecondSlotFromCryptsetupUnlocksTheSameKey) {
  // cryptsetup adds slot 1 (key material at sector 512, not 8) with another
  // passphrase: its IVs count from 0 at that sector, as slot 0's do.
  TempFile copy("luks1_copy");
  TempFile pass2("luks1_pass2");
  { std::ofstream(pass2.path()) << "second"; }
  std::string out;
  ASSERT_EQ(run_command(fmt::format("cp {} {} && cryptsetup luksAddKey -q "
                                    "--key-file {} --pbkdf-force-iterations "
                                    "1000 {} {}",
                                    image_->image.path(), copy.path(), image_->pass.path(), copy.path(), pass2.path()),
                        &out),
            0)
      << out;
  const std::vector<std::byte> file = read_file(copy.path());
  auto h = parse_luks1(file, file.size(), "copy");
  ASSERT_TRUE(h) << h.status().to_string();
  ASSERT_TRUE(h->slots[1].enabled());
  EXPECT_NE(h->slots[1].key_material_offset, h->slots[0].key_material_offset);
  auto first = unlock_luks1(*h, bytes_of("pw"), reader_of(file), "copy");
  auto second = unlock_luks1(*h, bytes_of("second"), reader_of(file), "copy");
  ASSERT_TRUE(first) << first.status().to_string();
  ASSERT_TRUE(second) << second.status().to_string();
  EXPECT_EQ(to_vector(*first), to_vector(*second));
  const testing::Dump d = dump_luks(image_->image.path(), image_->pass.path());
  EXPECT_EQ(to_vector(*first), d.key) << "cryptsetup's volume key differs";
  expect_pattern(file, *h, *first);
  EXPECT_EQ(unlock_luks1(*h, bytes_of(""), reader_of(file), "copy").status().code(), EACCES);
}

TEST_F(CryptoLuks1Hostile, ReadErrorsAreReturnedAsTheyAre) {
  auto h = parse_luks1(*file_, file_->size(), "img");
  ASSERT_TRUE(h) << h.status().to_string();
  ReadBytesFn failing = [](uint64_t, size_t) -> Result<std::vector<std::byte>> {
    return Status::error(EIO, "disk on fire");
  };
  EXPECT_EQ(unlock_luks1(*h, bytes_of("pw"), failing, "img").status().code(), EIO);
  ReadBytesFn short_read = [](uint64_t, size_t n) -> Result<std::vector<std::byte>> {
    return std::vector<std::byte>(n / 2);
  };
  auto st = unlock_luks1(*h, bytes_of("pw"), short_read, "img").status();
  EXPECT_EQ(st.code(), EIO);
  EXPECT_NE(st.message().find("short read"), std::string::npos) << st.message();
}

void put_be32(std::vector<std::byte> &b, size_t at, uint32_t v) {
  for (size_t i = 0; i < 4; ++i) b[at + i] = static_cast<std::byte>(v >> (24 - 8 * i));
}

void put_string(std::vector<std::byte> &b, size_t at, std::string_view s, size_t field = kLuks1NameBytes) {
  std::memset(b.data() + at, 0, field);
  std::memcpy(b.data() + at, s.data(), std::min(s.size(), field));
}

constexpr size_t slot_at(size_t i) { return kLuks1KeySlotsAt + i * kLuks1KeySlotBytes; }

struct Damage {
  const char *name;
  std::function<void(std::vector<std::byte> &)> patch;
  const char *message;  // a substring of the EINVAL message
};

TEST_F(CryptoLuks1Hostile, DamagedHeadersAreRefusedBeforeAnyDerivation) {
  const std::vector<Damage> cases = {
      {"iterations 0", [](auto &b) { put_be32(b, slot_at(0) + 4, 0); }, "key slot 0 has 0 iterations"},
      {"stripes 0", [](auto &b) { put_be32(b, slot_at(0) + 44, 0); }, "key slot 0 has 0 stripes (expected 1 to 65536)"},
      {"stripes huge", [](auto &b) { put_be32(b, slot_at(5) + 44, 1u << 30); }, "key slot 5 has 1073741824 stripes"},
      {"key material past the file",
       [](auto &b) {
         put_be32(b, 104, 0x7fffffff);  // payload moved out of the way
         put_be32(b, slot_at(0) + 40, 0x10000000);
       },
       "key slot 0 key material (sectors 268435456 to 268435955) lies past "
       "the end"},
      {"key material in the header", [](auto &b) { put_be32(b, slot_at(0) + 40, 1); },
       "key slot 0 key material at sector 1 overlaps the header"},
      {"key material over the payload", [](auto &b) { put_be32(b, 104, 600); },
       "key material (sectors 512 to 1011) overlaps the payload at sector 600"},
      {"overlapping slots", [](auto &b) { put_be32(b, slot_at(2) + 40, 700); },
       "key slots 1 and 2 overlap (sectors 512 to 1011 and 700 to 1199)"},
      {"active flag garbage", [](auto &b) { put_be32(b, slot_at(3), 0x12345678); },
       "key slot 3 state 0x12345678 is neither enabled nor disabled"},
      {"key_bytes 0", [](auto &b) { put_be32(b, 108, 0); }, "LUKS1 key of 0 bytes (expected 1 to 512)"},
      {"key_bytes 1000", [](auto &b) { put_be32(b, 108, 1000); }, "LUKS1 key of 1000 bytes"},
      {"key_bytes 24 for aes-xts", [](auto &b) { put_be32(b, 108, 24); },
       "unknown LUKS cipher 'aes' with a 24-byte key"},
      {"unknown hash", [](auto &b) { put_string(b, 72, "whirl"); }, "unknown LUKS1 hash spec 'whirl'"},
      {"unknown cipher", [](auto &b) { put_string(b, 8, "foo"); }, "unknown LUKS cipher 'foo'"},
      {"unknown mode", [](auto &b) { put_string(b, 40, "gcm-random"); }, "unknown LUKS cipher mode 'gcm-random'"},
      {"mode not terminated", [](auto &b) { std::memset(b.data() + 40, 'x', kLuks1NameBytes); },
       "cipher mode is not NUL-terminated"},
      {"digest iterations 0", [](auto &b) { put_be32(b, 164, 0); }, "master key digest iterations 0"},
      {"version 2", [](auto &b) { b[7] = std::byte{2}; }, "LUKS version 2 (expected 1)"},
      {"magic", [](auto &b) { b[0] = std::byte{'X'}; }, "no LUKS magic"},
      {"truncated head", [](auto &b) { b.resize(100); }, "LUKS1 header truncated (100 bytes, needs 592)"},
  };
  // The base image's slot 1 (disabled) has its key material at sector 512.
  auto base = parse_luks1(*file_, file_->size(), "hostile.img");
  ASSERT_TRUE(base) << base.status().to_string();
  ASSERT_EQ(base->slots[1].key_material_offset, 512u);
  ASSERT_EQ(base->slots[1].stripes, 4000u);
  for (const Damage &d : cases) {
    SCOPED_TRACE(d.name);
    std::vector<std::byte> bad = *file_;
    d.patch(bad);
    const auto start = std::chrono::steady_clock::now();
    auto h = parse_luks1(bad, bad.size(), "hostile.img");
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(100));
    ASSERT_FALSE(h);
    EXPECT_EQ(h.status().code(), EINVAL);
    EXPECT_NE(h.status().message().find(d.message), std::string::npos) << h.status().message();
    EXPECT_EQ(h.status().message().rfind("hostile.img: ", 0), 0u) << h.status().message();
  }
}

TEST_F(CryptoLuks1Hostile, ASlotOverTheIterationLimitIsRefusedBeforeDerivation) {
  // The header still parses (another slot could be usable); unlocking skips
  // the slot, and with no other slot refuses at once, deriving nothing.
  std::vector<std::byte> bad = *file_;
  put_be32(bad, slot_at(0) + 4, 0xffffffffu);
  auto h = parse_luks1(bad, bad.size(), "hostile.img");
  ASSERT_TRUE(h) << h.status().to_string();
  const auto start = std::chrono::steady_clock::now();
  auto key = unlock_luks1(*h, bytes_of("pw"), reader_of(bad), "hostile.img");
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(100));
  ASSERT_FALSE(key);
  EXPECT_EQ(key.status().code(), EINVAL);
  EXPECT_NE(key.status().message().find("hostile.img: LUKS key slot 0: pbkdf2 iterations 4294967295 exceeds the "
                                        "limit of 67108864"),
            std::string::npos)
      << key.status().message();
}

TEST(CryptoLuks1, AfMergeOfOneStripeIsTheStripeAndChecksItsSizes) {
  std::vector<std::byte> split(40, std::byte{7});
  std::vector<std::byte> out(40);
  ASSERT_TRUE(luks1_af_merge(split, HashAlg::sha256, out));
  EXPECT_EQ(out, split);
  std::vector<std::byte> odd(30);
  EXPECT_EQ(luks1_af_merge(split, HashAlg::sha256, odd).code(), EINVAL);
  EXPECT_EQ(luks1_af_merge({}, HashAlg::sha256, odd).code(), EINVAL);
}

}  // namespace
}  // namespace qcowfs::image::crypto
