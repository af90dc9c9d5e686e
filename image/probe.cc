#include "image/probe.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "image/endian.h"

namespace qcowfs::image {
namespace {

using Bytes = std::span<const std::byte>;

// ---- Signatures (QEMU block/*.c *_probe() and the formats' specifications) ----
constexpr std::string_view kQcowMagic{"QFI\xfb", 4};        // qcow and qcow2: magic, then be32 version
constexpr std::string_view kVmdk4Magic = "KDMV";            // VMDK sparse extent (incl. streamOptimized)
constexpr std::string_view kVmdk3Magic = "COWD";            // VMware 3 COWD sparse extent
constexpr std::string_view kVmdkDescriptor = "# Disk DescriptorFile";
constexpr std::string_view kVhdxMagic = "vhdxfile";
constexpr std::string_view kVhdCookie = "conectix";         // VHD footer (and its copy at 0 if dynamic)
constexpr size_t kVdiSignatureOffset = 64;                  // after the 64-byte text banner
constexpr uint32_t kVdiSignature = 0xbeda107f;              // little-endian
constexpr std::string_view kQedMagic{"QED\0", 4};
constexpr std::string_view kParallelsMagic = "WithoutFreeSpace";
constexpr std::string_view kParallelsMagic2 = "WithouFreSpacExt";
constexpr std::string_view kLuksMagic{"LUKS\xba\xbe", 6};
constexpr std::string_view kBochsMagic = "Bochs Virtual HD Image";
constexpr std::string_view kCloopMagic =
    "#!/bin/sh\n#V2.0 Format\nmodprobe cloop file=$0 && mount -r -t iso9660 /dev/cloop $1\n";
constexpr std::string_view kDmgTrailerMagic = "koly";       // UDIF trailer, last 512 bytes

bool starts_with(Bytes b, std::string_view magic) {
  return b.size() >= magic.size() && std::memcmp(b.data(), magic.data(), magic.size()) == 0;
}

// QEMU's vmdk_probe() text case: comment lines and blank lines, then a
// "version=1|2|3" line. A file that starts with the descriptor's usual first
// line is taken as a descriptor too.
bool is_vmdk_descriptor(Bytes b) {
  if (starts_with(b, kVmdkDescriptor)) return true;
  std::string_view s(reinterpret_cast<const char*>(b.data()), b.size());
  while (!s.empty()) {
    size_t eol = s.find('\n');
    if (eol == std::string_view::npos) return false;  // no complete line left
    std::string_view line = s.substr(0, eol);
    s.remove_prefix(eol + 1);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (!line.empty() && line.front() == '#') continue;
    if (line.find_first_not_of(' ') == std::string_view::npos) continue;
    return line == "version=1" || line == "version=2" || line == "version=3";
  }
  return false;
}

std::string_view detect_head(Bytes h) {
  // Other qcow2 versions (and a truncated header) are for the qcow2 driver to refuse.
  if (starts_with(h, kQcowMagic)) return h.size() >= 8 && load_be32(h.data() + 4) == 1 ? "qcow" : "qcow2";
  if (starts_with(h, kVmdk4Magic) || starts_with(h, kVmdk3Magic)) return "vmdk";
  if (starts_with(h, kVhdxMagic)) return "vhdx";
  if (starts_with(h, kVhdCookie)) return "vpc";
  if (starts_with(h, kQedMagic)) return "qed";
  if (starts_with(h, kParallelsMagic) || starts_with(h, kParallelsMagic2)) return "parallels";
  if (starts_with(h, kLuksMagic)) return "luks";
  if (starts_with(h, kBochsMagic)) return "bochs";
  if (starts_with(h, kCloopMagic)) return "cloop";
  if (h.size() >= kVdiSignatureOffset + 4 && load_le32(h.data() + kVdiSignatureOffset) == kVdiSignature) return "vdi";
  if (is_vmdk_descriptor(h)) return "vmdk";
  return {};
}

std::string_view detect_tail(Bytes t) {
  if (t.size() != kProbeTailBytes) return {};
  if (starts_with(t, kVhdCookie)) return "vpc";  // fixed VHD: the footer is all there is
  if (starts_with(t, kDmgTrailerMagic)) return "dmg";
  return {};
}

}  // namespace

const FormatInfo& detect_format(Bytes head, Bytes tail) {
  std::string_view name = detect_head(head.first(std::min(head.size(), kProbeHeadBytes)));
  if (name.empty()) name = detect_tail(tail);
  if (name.empty()) name = "raw";
  return *find_format(name);  // every name above is in the registry (image_probe_test checks it)
}

Task<Result<const FormatInfo*>> probe_format_info(io::HostFile& file) {
  std::vector<std::byte> head(kProbeHeadBytes), tail;
  auto n = co_await file.read(0, head);
  if (!n) co_return n.status().with_context("probing format");
  head.resize(*n);
  // A signature at the start decides alone: the tail (a fixed VHD's footer, a
  // DMG trailer) is read only without one (over a network a read is a round trip).
  uint64_t size = file.size();
  if (detect_head(head).empty() && size >= kProbeTailBytes) {
    tail.resize(kProbeTailBytes);
    auto t = co_await file.read(size - kProbeTailBytes, tail);
    if (!t) co_return t.status().with_context("probing format (file tail)");
    tail.resize(*t);
  }
  co_return &detect_format(head, tail);
}

Status foreign_format_error(const std::string& path, const FormatInfo& f, bool named, std::string_view backing_of) {
  if (!backing_of.empty() && named)
    return Status::errorf(EMEDIUMTYPE, "{} records backing_fmt={} for {}: qcowfs does not read {} images yet",
                          backing_of, f.name, path, f.display);
  if (!backing_of.empty())
    return Status::errorf(EMEDIUMTYPE,
                          "{} is a {} image, which qcowfs does not read yet; to use the container file itself as "
                          "a raw backing file, record backing_fmt=raw in {} (qemu-img rebase -u -b {} -F raw {})",
                          path, f.display, backing_of, path, backing_of);
  constexpr std::string_view kRawHint =
      "to serve the container file itself as a raw disk, mount with -o format=raw (-f raw for qcowfs info, check "
      "and map)";
  if (named)
    return Status::errorf(EMEDIUMTYPE, "{}: format {} ({}) is not one qcowfs reads yet; {}", path, f.name, f.display,
                          kRawHint);
  return Status::errorf(EMEDIUMTYPE, "{} is a {} image, which qcowfs does not read yet; {}", path, f.display, kRawHint);
}

Status named_format_mismatch(const std::string& path, const FormatInfo& named, const FormatInfo& probed) {
  const std::string head = fmt::format("{}: format={} is {}, which qcowfs does not read, and the file is not one",
                                       path, named.name, named.display);
  if (probed.name == "raw")
    return Status::errorf(EMEDIUMTYPE,
                          "{}: its bytes match no image format qcowfs knows; if it is a raw disk, use format=raw "
                          "(-f raw for qcowfs info, check and map)",
                          head);
  if (!probed.supported())
    return Status::errorf(EMEDIUMTYPE, "{}: it looks like a {} image, which qcowfs does not read yet", head,
                          probed.display);
  return Status::errorf(EMEDIUMTYPE,
                        "{}: it looks like a {} image; did you mean format={} (-f {} for qcowfs info, check and map)?",
                        head, probed.display, probed.name, probed.name);
}

}  // namespace qcowfs::image
