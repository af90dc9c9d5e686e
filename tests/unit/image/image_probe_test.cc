// Format probing (image/probe.h): every recognised signature, the near misses
// that must stay raw, and choose_format()'s refusals over a MemFile.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "image/block_driver.h"
#include "image/probe.h"
#include "io/engine.h"
#include "io/mem_file.h"
#include "io/run_sync.h"

namespace qcowfs::image {
namespace {

using Bytes = std::vector<std::byte>;

Bytes bytes(std::string_view s, size_t size = 0) {
  Bytes b(std::max(size, s.size()), std::byte{0});
  std::memcpy(b.data(), s.data(), s.size());
  return b;
}

void put_le32(Bytes& b, size_t off, uint32_t v) {
  for (size_t i = 0; i < 4; ++i) b[off + i] = std::byte(static_cast<uint8_t>(v >> (8 * i)));
}

std::string_view head_format(const Bytes& head) { return detect_format(head, {}).name; }

// A whole file: head and tail as probe_format_info() would read them.
std::string_view file_format(const Bytes& file) {
  Bytes head(file.begin(), file.begin() + static_cast<long>(std::min(file.size(), kProbeHeadBytes)));
  Bytes tail;
  if (file.size() >= kProbeTailBytes) tail.assign(file.end() - static_cast<long>(kProbeTailBytes), file.end());
  return detect_format(head, tail).name;
}

TEST(ImageProbe, QcowMagicIsQcow2UnlessVersion1) {
  EXPECT_EQ(head_format(bytes(std::string_view("QFI\xfb\0\0\0\3", 8), 512)), "qcow2");
  EXPECT_EQ(head_format(bytes(std::string_view("QFI\xfb\0\0\0\2", 8), 512)), "qcow2");
  EXPECT_EQ(head_format(bytes(std::string_view("QFI\xfb\0\0\0\1", 8), 512)), "qcow");
  EXPECT_FALSE(detect_format(bytes(std::string_view("QFI\xfb\0\0\0\1", 8)), {}).supported());
  // A truncated qcow2 header is for the qcow2 driver to refuse, not raw.
  EXPECT_EQ(head_format(bytes("QFI\xfb")), "qcow2");
}

TEST(ImageProbe, EveryForeignMagicAtOffsetZero) {
  const std::pair<std::string_view, std::string_view> cases[] = {
      {"KDMV", "vmdk"},
      {"COWD", "vmdk"},
      {"vhdxfile", "vhdx"},
      {"conectix", "vpc"},
      {std::string_view("QED\0", 4), "qed"},
      {"WithoutFreeSpace", "parallels"},
      {"WithouFreSpacExt", "parallels"},
      {std::string_view("LUKS\xba\xbe\0\1", 8), "luks"},
      {std::string_view("LUKS\xba\xbe\0\2", 8), "luks"},
      {"Bochs Virtual HD Image", "bochs"},
      {"#!/bin/sh\n#V2.0 Format\nmodprobe cloop file=$0 && mount -r -t iso9660 /dev/cloop $1\n", "cloop"},
  };
  for (auto [magic, name] : cases) {
    const FormatInfo& f = detect_format(bytes(magic, 1024), {});
    EXPECT_EQ(f.name, name) << magic;
    // The formats read so far open; the others are only recognised.
    const bool reads =
        name == "vhdx" || name == "vpc" || name == "parallels" || name == "qed" || name == "vmdk" || name == "luks";
    EXPECT_EQ(f.supported(), reads) << magic;
    EXPECT_FALSE(f.display.empty());
  }
}

TEST(ImageProbe, VdiSignatureAtOffset64LittleEndian) {
  Bytes b = bytes("<<< Oracle VM VirtualBox Disk Image >>>\n", 512);
  put_le32(b, 64, 0xbeda107f);
  EXPECT_EQ(head_format(b), "vdi");
  Bytes big_endian = bytes("", 512);
  big_endian[64] = std::byte{0xbe};
  big_endian[65] = std::byte{0xda};
  big_endian[66] = std::byte{0x10};
  big_endian[67] = std::byte{0x7f};
  EXPECT_EQ(head_format(big_endian), "raw");
  Bytes cut(b.begin(), b.begin() + 67);  // signature cut short by the end of the file
  EXPECT_EQ(head_format(cut), "raw");
}

TEST(ImageProbe, VmdkDescriptors) {
  EXPECT_EQ(head_format(bytes("# Disk DescriptorFile\nversion=1\nCID=fffffffe\n")), "vmdk");
  EXPECT_EQ(head_format(bytes("# Disk DescriptorFile")), "vmdk");
  // QEMU's rule: comments and blank lines, then version=1|2|3 (CRLF too).
  EXPECT_EQ(head_format(bytes("# made by hand\r\n   \r\nversion=3\r\nCID=1\r\n")), "vmdk");
  EXPECT_EQ(head_format(bytes("version=2\n")), "vmdk");
  EXPECT_EQ(head_format(bytes("version=4\n")), "raw");
  EXPECT_EQ(head_format(bytes("# a comment\nCID=1\nversion=1\n")), "raw");
  EXPECT_EQ(head_format(bytes("# a comment\nversion=1")), "raw");  // no end of line
}

TEST(ImageProbe, VhdFooterInTheLastSector) {
  Bytes fixed = bytes("", 1 << 20);
  std::memcpy(fixed.data() + fixed.size() - 512, "conectix", 8);
  EXPECT_EQ(file_format(fixed), "vpc");
  Bytes exactly_one_sector = bytes("conectix", 512);
  EXPECT_EQ(file_format(exactly_one_sector), "vpc");
}

TEST(ImageProbe, DmgTrailerInTheLastSector) {
  Bytes dmg = bytes("", 64 * 1024);
  std::memcpy(dmg.data() + dmg.size() - 512, "koly", 4);
  EXPECT_EQ(file_format(dmg), "dmg");
}

TEST(ImageProbe, NearMissesStayRaw) {
  EXPECT_EQ(file_format({}), "raw");
  EXPECT_EQ(file_format(bytes("KDM")), "raw");                 // 3 bytes
  EXPECT_EQ(file_format(bytes("", 1 << 16)), "raw");           // zeros
  EXPECT_EQ(file_format(bytes("kdmv", 512)), "raw");           // case matters
  EXPECT_EQ(file_format(bytes("vhdxfil", 512)), "raw");
  EXPECT_EQ(file_format(bytes("QED", 512)), "qed");            // "QED\0": the NUL is in the zeros
  EXPECT_EQ(file_format(bytes("QEDX", 512)), "raw");
  EXPECT_EQ(file_format(bytes("WithoutFreeSpac", 512)), "raw");
  EXPECT_EQ(file_format(bytes("LUKS\xba", 512)), "raw");
  // An MBR: boot code, a partition entry, 0x55aa.
  Bytes mbr = bytes("\xfa\x31\xc0\x8e\xd8", 1 << 20);
  mbr[446 + 4] = std::byte{0x83};
  mbr[510] = std::byte{0x55};
  mbr[511] = std::byte{0xaa};
  EXPECT_EQ(file_format(mbr), "raw");
  // "conectix" in the last bytes of a file shorter than a footer.
  Bytes short_file = bytes("", 300);
  std::memcpy(short_file.data() + 292, "conectix", 8);
  EXPECT_EQ(file_format(short_file), "raw");
  // ... and in the last sector but not at its start.
  Bytes shifted = bytes("", 4096);
  std::memcpy(shifted.data() + 4096 - 511, "conectix", 8);
  EXPECT_EQ(file_format(shifted), "raw");
  // A magic beyond the probed head does not count.
  Bytes late = bytes("", 8192);
  std::memcpy(late.data() + kProbeHeadBytes, "KDMV", 4);
  EXPECT_EQ(file_format(late), "raw");
}

TEST(ImageProbe, HeadLongerThanTheProbeWindowIsCut) {
  // The version line of a descriptor past kProbeHeadBytes is not seen.
  std::string text(kProbeHeadBytes, '\n');
  text += "version=1\n";
  EXPECT_EQ(head_format(bytes(text)), "raw");
}

TEST(ImageProbe, FindFormatKnowsQemuNames) {
  for (std::string_view n : {"raw", "qcow2", "qcow", "vmdk", "vhdx", "vpc", "vdi", "qed", "parallels", "luks",
                             "bochs", "cloop", "dmg"})
    ASSERT_NE(find_format(n), nullptr) << n;
  EXPECT_EQ(find_format("vhd")->name, "vpc");
  EXPECT_EQ(find_format("nonsense"), nullptr);
  EXPECT_TRUE(find_format("raw")->supported());
  EXPECT_TRUE(find_format("qcow2")->supported());
  EXPECT_TRUE(find_format("vmdk")->supported());
  EXPECT_FALSE(find_format("bochs")->supported());
}

class ImageChooseFormat : public ::testing::Test {
 protected:
  void SetUp() override {
    auto e = io::make_engine(io::EngineKind::threads);
    ASSERT_TRUE(e) << e.status().to_string();
    engine_ = std::move(*e);
  }
  Result<std::string> choose(Bytes content, std::string_view named, std::string_view backing_of = {}) {
    io::MemFile f({}, std::move(content));
    return io::run_sync(*engine_, choose_format(f, "disk.img", std::string(named), std::string(backing_of)));
  }
  std::unique_ptr<io::Engine> engine_;
};

TEST_F(ImageChooseFormat, ProbedForeignFormatIsRefusedByName) {
  auto r = choose(bytes("Bochs Virtual HD Image", 4096), "");
  ASSERT_FALSE(r);
  EXPECT_EQ(r.status().code(), EMEDIUMTYPE);
  EXPECT_NE(r.status().message().find("disk.img is a Bochs image"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("format=raw"), std::string::npos) << r.status().message();
}

TEST_F(ImageChooseFormat, FixedVhdIsFoundByItsFooter) {
  Bytes b = bytes("", 1 << 20);
  std::memcpy(b.data() + b.size() - 512, "conectix", 8);
  auto r = choose(b, "");
  ASSERT_TRUE(r) << r.status().to_string();
  EXPECT_EQ(*r, "vpc");
}

// A signature at offset 0 decides: the tail is not read (over a network each
// read is a round trip at mount); without one both ends are read.
TEST_F(ImageChooseFormat, TailIsReadOnlyWithoutASignatureAtTheStart) {
  io::MemFile qcow2({}, bytes(std::string_view("QFI\xfb\0\0\0\3", 8), 1 << 20));
  auto r = io::run_sync(*engine_, probe_format_info(qcow2));
  ASSERT_TRUE(r) << r.status().to_string();
  EXPECT_EQ((*r)->name, "qcow2");
  EXPECT_EQ(qcow2.counters().reads, 1u);
  io::MemFile raw({}, bytes("", 1 << 20));
  r = io::run_sync(*engine_, probe_format_info(raw));
  ASSERT_TRUE(r) << r.status().to_string();
  EXPECT_EQ((*r)->name, "raw");
  EXPECT_EQ(raw.counters().reads, 2u);
}

TEST_F(ImageChooseFormat, ExplicitRawServesAForeignFile) {
  auto r = choose(bytes("KDMV", 4096), "raw");
  ASSERT_TRUE(r) << r.status().to_string();
  EXPECT_EQ(*r, "raw");
}

TEST_F(ImageChooseFormat, NamedForeignFormatIsRefused) {
  auto r = choose(bytes("", 4096), "dmg");
  ASSERT_FALSE(r);
  EXPECT_EQ(r.status().code(), EMEDIUMTYPE);
  EXPECT_NE(r.status().message().find("DMG"), std::string::npos) << r.status().message();
}

// format=qcow (a typo) on a qcow2 file: say what the bytes are, not format=raw
// (which would serve the container as the disk).
TEST_F(ImageChooseFormat, NamedForeignFormatOverAnotherFormatSaysWhatTheBytesAre) {
  auto r = choose(bytes(std::string_view("QFI\xfb\0\0\0\3", 8), 4096), "qcow");
  ASSERT_FALSE(r);
  EXPECT_EQ(r.status().code(), EMEDIUMTYPE);
  const std::string& m = r.status().message();
  EXPECT_NE(m.find("looks like a qcow2 image; did you mean format=qcow2"), std::string::npos) << m;
  EXPECT_EQ(m.find("format=raw"), std::string::npos) << m;
  auto dmg_over_bochs = choose(bytes("Bochs Virtual HD Image", 4096), "dmg");
  ASSERT_FALSE(dmg_over_bochs);
  EXPECT_NE(dmg_over_bochs.status().message().find("looks like a Bochs image"), std::string::npos)
      << dmg_over_bochs.status().message();
  auto over_raw = choose(bytes("", 4096), "qcow");  // no format's bytes: a raw disk may be meant
  ASSERT_FALSE(over_raw);
  EXPECT_NE(over_raw.status().message().find("match no image format"), std::string::npos)
      << over_raw.status().message();
}

TEST_F(ImageChooseFormat, UnknownNameIsEinval) {
  auto r = choose(bytes("", 4096), "floppy");
  ASSERT_FALSE(r);
  EXPECT_EQ(r.status().code(), EINVAL);
}

TEST_F(ImageChooseFormat, BackingFileMessagesNameTheOverlay) {
  auto probed = choose(bytes("Bochs Virtual HD Image", 4096), "", "ov.qcow2");
  ASSERT_FALSE(probed);
  EXPECT_NE(probed.status().message().find("disk.img is a Bochs image"), std::string::npos)
      << probed.status().message();
  EXPECT_NE(probed.status().message().find("backing_fmt=raw in ov.qcow2"), std::string::npos)
      << probed.status().message();
  auto named = choose(bytes("", 4096), "bochs", "ov.qcow2");
  ASSERT_FALSE(named);
  EXPECT_NE(named.status().message().find("ov.qcow2 records backing_fmt=bochs for disk.img"), std::string::npos)
      << named.status().message();
}

TEST_F(ImageChooseFormat, EmptyAndRawFilesAreRaw) {
  auto empty = choose({}, "");
  ASSERT_TRUE(empty) << empty.status().to_string();
  EXPECT_EQ(*empty, "raw");
  auto zeros = choose(bytes("", 3), "");
  ASSERT_TRUE(zeros) << zeros.status().to_string();
  EXPECT_EQ(*zeros, "raw");
}

}  // namespace
}  // namespace qcowfs::image
