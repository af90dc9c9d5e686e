// SectorCipher against QEMU: for AES in each mode and IV generator, a LUKS1
// image is made and written with qemu-io, its volume key taken from `cryptsetup
// luksDump --dump-master-key`, and the payload decrypted here must be qemu-io's
// pattern (and encrypting the pattern again must give the file's bytes). Plus
// the IV and spec rules.
#include "image/crypto/cipher.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "unit/crypto/crypto_test_util.h"
#include "io/engine.h"
#include "io/run_sync.h"
#include "unit/io/io_test_util.h"

namespace qcowfs::image::crypto {
namespace {

using io::testing::run_command;
using io::testing::TempFile;
using testing::Dump;
using testing::dump_luks;
using testing::qemu_img_create_luks;
using testing::read_file;

struct Combo {
  const char *alg;
  const char *mode;
  const char *ivgen;
  const char *hash;  // essiv only
};

class QemuLuksCipher : public ::testing::TestWithParam<Combo> {};

TEST_P(QemuLuksCipher, DecryptsWhatQemuWroteAndEncryptsItBack) {
  const Combo c = GetParam();
  TempFile image("cipher_luks");
  TempFile pass("cipher_pass");
  { std::ofstream(pass.path()) << "pw"; }
  std::string opts =
      fmt::format("key-secret=s0,iter-time=10,cipher-alg={},cipher-mode={},ivgen-alg={}", c.alg, c.mode, c.ivgen);
  if (*c.hash) opts += fmt::format(",ivgen-hash-alg={}", c.hash);
  std::string out;
  ASSERT_EQ(qemu_img_create_luks(image.path(), opts, &out), 0) << out;
  // Patterns at sectors 0..7 and 1000..1015 (sector numbers past 255 and in
  // the second 32-bit word do not arise in 1 MiB; plain vs plain64 is tested
  // below).
  ASSERT_EQ(run_command(fmt::format("qemu-io --object secret,id=s0,data=pw --image-opts "
                                    "driver=luks,key-secret=s0,file.filename={} -c 'write -P "
                                    "0x5a 0 4096' "
                                    "-c 'write -P 0xc3 512000 8192'",
                                    image.path()),
                        &out),
            0)
      << out;
  const Dump d = dump_luks(image.path(), pass.path());
  ASSERT_GT(d.payload_offset, 0u);
  const std::vector<std::byte> file = read_file(image.path());
  ASSERT_GE(file.size(), d.payload_offset + (1 << 20));

  auto mode = parse_cipher_mode(c.mode);
  auto name = luks_cipher_name(CipherSpec{*parse_cipher_alg(c.alg)});
  std::string mode_string = std::string(c.mode) + "-" + c.ivgen + (*c.hash ? std::string(":") + c.hash : "");
  ASSERT_TRUE(mode);
  auto spec = spec_from_luks(name, mode_string, d.key.size());
  ASSERT_TRUE(spec) << spec.status().to_string();
  EXPECT_EQ(name_of(spec->alg), c.alg);
  EXPECT_EQ(luks_cipher_mode(*spec), mode_string);
  auto cipher = SectorCipher::create(*spec, d.key);
  ASSERT_TRUE(cipher) << cipher.status().to_string();

  for (auto [off, len, pat] : {std::tuple{0u, 4096u, 0x5a}, std::tuple{512000u, 8192u, 0xc3}}) {
    std::vector<std::byte> buf(file.begin() + static_cast<long>(d.payload_offset + off),
                               file.begin() + static_cast<long>(d.payload_offset + off + len));
    const std::vector<std::byte> stored = buf;
    ASSERT_TRUE((*cipher)->decrypt(off, buf)) << c.alg << " " << mode_string;
    for (size_t i = 0; i < buf.size(); ++i)
      ASSERT_EQ(buf[i], std::byte(pat)) << c.alg << " " << mode_string << " at " << off + i;
    ASSERT_TRUE((*cipher)->encrypt(off, buf));
    EXPECT_EQ(buf, stored) << "re-encryption differs from QEMU's ciphertext";
  }
}

INSTANTIATE_TEST_SUITE_P(AllQemuCombos, QemuLuksCipher,
                         // The AES combinations: cryptsetup's key dump decrypts key slots with
                         // OpenSSL, which has no Serpent, Twofish, CAST5 or 192-bit XTS (this
                         // kernel has no AF_ALG or device-mapper to fall back on). The other
                         // ciphers are checked through the key slots (crypto_luks1_test.cc) and
                         // through the mount (test_encryption.py).
                         ::testing::Values(Combo{"aes-256", "xts", "plain64", ""}, Combo{"aes-128", "xts", "plain", ""},
                                           Combo{"aes-256", "cbc", "essiv", "sha256"},
                                           Combo{"aes-128", "cbc", "plain64", ""},
                                           Combo{"aes-256", "ctr", "plain64", ""}),
                         [](const ::testing::TestParamInfo<Combo> &i) {
                           std::string n =
                               fmt::format("{}_{}_{}{}", i.param.alg, i.param.mode, i.param.ivgen, i.param.hash);
                           for (char &ch : n)
                             if (ch == '-') ch = '_';
                           return n;
                         });

std::vector<std::byte> key_of(size_t n) {
  std::vector<std::byte> k(n);
  for (size_t i = 0; i < n; ++i) k[i] = static_cast<std::byte>(i * 7 + 1);
  return k;
}

TEST(CryptoCipher, PlainTruncatesTheSectorNumberAndPlain64DoesNot) {
  CipherSpec plain{CipherAlg::aes_256, CipherMode::xts, IvGenAlg::plain};
  CipherSpec plain64{CipherAlg::aes_256, CipherMode::xts, IvGenAlg::plain64};
  auto a = SectorCipher::create(plain, key_of(64));
  auto b = SectorCipher::create(plain64, key_of(64));
  ASSERT_TRUE(a && b);
  std::vector<std::byte> x(512, std::byte{1}), y = x, z = x;
  const uint64_t high = (uint64_t{1} << 32) * 512;  // sector 2^32: plain wraps to sector 0
  ASSERT_TRUE((*a)->encrypt(high, x));
  ASSERT_TRUE((*a)->encrypt(0, y));
  EXPECT_EQ(x, y);
  ASSERT_TRUE((*b)->encrypt(high, z));
  EXPECT_NE(z, y);
  ASSERT_TRUE((*b)->decrypt(high, z));
  EXPECT_EQ(z, std::vector<std::byte>(512, std::byte{1}));
}

TEST(CryptoCipher, LargeSectorsUseOneIvPerSector) {
  CipherSpec s{CipherAlg::aes_128, CipherMode::xts, IvGenAlg::plain64, HashAlg::sha256, 4096};
  auto c = SectorCipher::create(s, key_of(32));
  ASSERT_TRUE(c);
  std::vector<std::byte> buf(8192, std::byte{9});
  ASSERT_TRUE((*c)->encrypt(4096, buf));
  std::vector<std::byte> second(buf.begin() + 4096, buf.end());
  // Sector 2 of 4 KiB alone gives the same bytes: its IV is 2, from offset
  // 8192.
  std::vector<std::byte> again(4096, std::byte{9});
  ASSERT_TRUE((*c)->encrypt(8192, again));
  EXPECT_EQ(again, second);
  std::vector<std::byte> odd(512);
  EXPECT_EQ((*c)->encrypt(512, odd).code(), EINVAL);
  EXPECT_EQ((*c)->encrypt(4096, std::span(odd).first(100)).code(), EINVAL);
}

TEST(CryptoCipher, RefusesWhatQemuAndTheLibraryCannotDo) {
  EXPECT_EQ(check_spec(CipherSpec{CipherAlg::cast5_128, CipherMode::xts}).code(), ENOTSUP);
  EXPECT_TRUE(check_spec(CipherSpec{CipherAlg::twofish_192, CipherMode::xts}));  // through nettle
  EXPECT_EQ(check_spec(CipherSpec{CipherAlg::aes_256, CipherMode::cbc, IvGenAlg::essiv, HashAlg::sha1}).code(),
            ENOTSUP);
  EXPECT_TRUE(check_spec(CipherSpec{CipherAlg::aes_128, CipherMode::cbc, IvGenAlg::essiv, HashAlg::sha256}));
  EXPECT_FALSE(spec_from_luks("aes", "xts-plain64", 63));
  EXPECT_FALSE(spec_from_luks("aes", "xts-plain64", 40));
  EXPECT_FALSE(spec_from_luks("des", "cbc-plain64", 8));
  EXPECT_FALSE(spec_from_luks("aes", "cbc-essiv", 32));
  EXPECT_FALSE(spec_from_luks("aes", "cbc-essiv:whirlpool", 32));
  EXPECT_FALSE(spec_from_luks("aes", "gcm-random", 32));
  EXPECT_FALSE(spec_from_luks("aes", "xts-plain64", 64, 1000));
  auto ecb = spec_from_luks("aes", "ecb", 32);
  ASSERT_TRUE(ecb);
  EXPECT_EQ(ecb->mode, CipherMode::ecb);
  EXPECT_EQ(SectorCipher::create(CipherSpec{}, key_of(32)).status().code(),
            EINVAL);  // aes-256-xts takes 64
}

TEST(CryptoCipher, LegacyQcowKeyIsThePassphrasePaddedTo16Bytes) {
  auto a = SectorCipher::legacy_qcow_aes(std::as_bytes(std::span("secret", 6)));
  std::vector<std::byte> key(16);
  std::memcpy(key.data(), "secret", 6);
  auto b = SectorCipher::create(CipherSpec{CipherAlg::aes_128, CipherMode::cbc, IvGenAlg::plain64}, key);
  ASSERT_TRUE(a && b);
  std::vector<std::byte> x(1024, std::byte{3}), y = x;
  ASSERT_TRUE((*a)->encrypt(512, x));
  ASSERT_TRUE((*b)->encrypt(512, y));
  EXPECT_EQ(x, y);
  EXPECT_NE(x, std::vector<std::byte>(1024, std::byte{3}));
}

TEST(CryptoCipher, AsyncSplitsLargeBuffersOverWorkersWithTheSameResult) {
  auto c = SectorCipher::create(CipherSpec{}, key_of(64));
  ASSERT_TRUE(c);
  std::vector<std::byte> big(1 << 20);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<std::byte>(i * 31);
  std::vector<std::byte> sync = big, async = big;
  ASSERT_TRUE((*c)->encrypt(1 << 20, sync));
  auto engine = io::make_engine(io::EngineKind::automatic);
  ASSERT_TRUE(engine) << engine.status().to_string();
  Status st = io::run_sync(**engine, encrypt_async(**c, 1 << 20, async));
  ASSERT_TRUE(st) << st.to_string();
  EXPECT_EQ(async, sync);
  st = io::run_sync(**engine, decrypt_async(**c, 1 << 20, async));
  ASSERT_TRUE(st);
  EXPECT_EQ(async, big);
}

}  // namespace
}  // namespace qcowfs::image::crypto
