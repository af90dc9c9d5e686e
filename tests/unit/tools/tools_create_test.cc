// qcowfs create's encryption options end to end in a temporary directory: the
// usage lists them, a key file makes a qcow2 image with a LUKS area and a raw
// LUKS image, and every refusal exits non-zero leaving no file behind.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "image/endian.h"
#include "image/format.h"
#include "image/qcow2/format.h"
#include "tools/cmd.h"

namespace qcowfs::tools {
namespace {

class CreateEncrypted : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (std::filesystem::temp_directory_path() / "qcowfs-create-XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
    key_ = (dir_ / "key").string();
    std::ofstream(key_) << "passphrase";
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  int create(std::vector<std::string> args) { return cmd_create(args); }
  std::string path(const char* name) const { return (dir_ / name).string(); }
  std::vector<char> head(const std::string& p, size_t n) const {
    std::vector<char> b(n);
    std::ifstream(p, std::ios::binary).read(b.data(), static_cast<std::streamsize>(n));
    return b;
  }

  std::filesystem::path dir_;
  std::string key_;
};

TEST_F(CreateEncrypted, UsageListsTheOptions) {
  const std::string_view u = create_usage();
  for (const char* o :
       {"encrypt.format=luks", "encrypt.key-file", "encrypt.cipher-alg", "encrypt.cipher-mode", "encrypt.ivgen-alg",
        "encrypt.ivgen-hash-alg", "encrypt.hash-alg", "encrypt.iter-time", "-f luks"})
    EXPECT_NE(u.find(o), std::string_view::npos) << o;
}

TEST_F(CreateEncrypted, Qcow2WithAKeyFileHasALuksArea) {
  const std::string img = path("e.qcow2");
  ASSERT_EQ(create({"-q", "-o", "encrypt.format=luks,encrypt.key-file=" + key_ + ",encrypt.iter-time=10", img, "1M"}),
            0);
  auto h = head(img, 112);
  EXPECT_EQ(image::load_be32(reinterpret_cast<const std::byte*>(h.data()) + 32), image::qcow2::kCryptLuks);
  EXPECT_EQ(std::filesystem::file_size(img), 4 * 65536 + 2097152u) << "header, reftable, refblock, L1, LUKS area";
}

TEST_F(CreateEncrypted, RawLuksIsHeaderPlusSize) {
  const std::string img = path("e.luks");
  ASSERT_EQ(create({"-q", "-f", "luks", "-o", "key-file=" + key_ + ",iter-time=10", img, "1M"}), 0);
  auto h = head(img, 6);
  EXPECT_EQ(std::string(h.data(), 4), "LUKS");
  EXPECT_EQ(std::filesystem::file_size(img), 2068480u + (1u << 20));
}

TEST_F(CreateEncrypted, RefusalsLeaveNoFile) {
  const std::string img = path("bad.img");
  const std::vector<std::vector<std::string>> bad = {
      {"-o", "encryption=on"},
      {"-o", "encrypt.format=aes"},
      {"-o", "encrypt.format=luks,encrypt.key-file=" + path("missing")},
      {"-o", "encrypt.format=luks,encrypt.key-file=" + key_ + ",preallocation=full"},
      {"-o", "encrypt.iter-time=10"},
      {"-f", "luks", "-o", "key-file=" + path("missing")},
      {"-f", "luks", "-o", "key-file=" + key_ + ",lazy_refcounts=on"},
      {"-f", "raw", "-o", "encrypt.format=luks"},
  };
  for (const auto& b : bad) {
    std::vector<std::string> args = {"-q"};
    args.insert(args.end(), b.begin(), b.end());
    args.insert(args.end(), {img, "1M"});
    EXPECT_NE(create(args), 0) << b.back();
    EXPECT_FALSE(std::filesystem::exists(img)) << b.back();
  }
}

// tools/create.cc knows formats only through the registry: every format qcowfs
// opens is one create makes (no format is built in beside the table), and
// the default format is one of them.
TEST(CreateRegistry, EveryFormatQcowfsOpensHasACreate) {
  for (const image::FormatInfo& f : image::all_formats()) {
    if (f.supported()) {
      EXPECT_NE(f.prepare_create, nullptr) << f.name;
    }
  }
  const image::FormatInfo* def = image::find_format(image::default_create_format());
  ASSERT_NE(def, nullptr);
  EXPECT_NE(def->prepare_create, nullptr);
  EXPECT_EQ(image::creatable_format_names(), "raw, qcow2, vmdk, vhdx, vpc, vdi, qed, parallels, luks");
}

// The data file is made first; when the image then cannot be created, the data file goes again.
TEST_F(CreateEncrypted, AFailedCreateRemovesWhatItMade) {
  const std::string data = path("d.raw");
  EXPECT_NE(create({"-q", "-o", "data_file=" + data, path("no-such-dir/x.qcow2"), "1M"}), 0);
  EXPECT_FALSE(std::filesystem::exists(data));
}

}  // namespace
}  // namespace qcowfs::tools
