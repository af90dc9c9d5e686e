#include "image/qcow2/header.h"

#include <cstring>

#include "image/endian.h"
#include "io/align.h"

namespace qcowfs::image::qcow2 {
namespace {

template <typename T>
T field(std::span<const std::byte> b, size_t at) {
  return load_be<T>(b.data() + at);
}

#define QCOW2_FIELD(buf, name) \
  field<decltype(HeaderLayout::name)>(buf, offsetof(HeaderLayout, name))

Status invalid(std::string msg) { return Status::error(EINVAL, "invalid qcow2 header: " + msg); }

std::string bytes_to_string(std::span<const std::byte> b) {
  return std::string(reinterpret_cast<const char*>(b.data()), b.size());
}

Status check_table(std::string_view what, HostOffset host, uint64_t len, const Header& h, uint64_t file_size) {
  if (!is_aligned(host, h.cluster_size()))
    return invalid(fmt::format("{} offset {:#x} is not cluster aligned", what, host));
  if (!range_inside_file(host, len, h.cluster_size(), file_size))
    return invalid(fmt::format("{} at {:#x} ({} bytes) is outside the image file (size {}) or in the header",
                               what, host, len, file_size));
  return Status::ok();
}

Status parse_fixed_fields(std::span<const std::byte> b, Header& h) {
  h.version = QCOW2_FIELD(b, version);
  h.backing_file_offset = QCOW2_FIELD(b, backing_file_offset);
  h.backing_file_size = QCOW2_FIELD(b, backing_file_size);
  h.cluster_bits = QCOW2_FIELD(b, cluster_bits);
  h.size = QCOW2_FIELD(b, size);
  h.crypt_method = QCOW2_FIELD(b, crypt_method);
  h.l1_size = QCOW2_FIELD(b, l1_size);
  h.l1_table_offset = QCOW2_FIELD(b, l1_table_offset);
  h.refcount_table_offset = QCOW2_FIELD(b, refcount_table_offset);
  h.refcount_table_clusters = QCOW2_FIELD(b, refcount_table_clusters);
  h.nb_snapshots = QCOW2_FIELD(b, nb_snapshots);
  h.snapshots_offset = QCOW2_FIELD(b, snapshots_offset);
  if (h.version == 2) {
    h.incompatible_features = h.compatible_features = h.autoclear_features = 0;
    h.refcount_order = kV2RefcountOrder;
    h.header_length = kV2HeaderLength;
    h.compression_type = kCompressionZlib;
    return Status::ok();
  }
  h.incompatible_features = QCOW2_FIELD(b, incompatible_features);
  h.compatible_features = QCOW2_FIELD(b, compatible_features);
  h.autoclear_features = QCOW2_FIELD(b, autoclear_features);
  h.refcount_order = QCOW2_FIELD(b, refcount_order);
  h.header_length = QCOW2_FIELD(b, header_length);
  if (h.header_length < kV3MinHeaderLength || h.header_length % 8 != 0)
    return invalid(fmt::format("header_length {} (must be >= {} and a multiple of 8)", h.header_length,
                               kV3MinHeaderLength));
  if (h.header_length > h.cluster_size())
    return invalid(fmt::format("header_length {} exceeds the cluster size", h.header_length));
  h.compression_type = h.header_length > offsetof(HeaderLayout, compression_type)
                           ? QCOW2_FIELD(b, compression_type)
                           : kCompressionZlib;
  if (h.header_length > sizeof(HeaderLayout))
    h.unknown_header_fields.assign(b.begin() + sizeof(HeaderLayout), b.begin() + h.header_length);
  return Status::ok();
}

Status check_compression(const Header& h) {
  if (h.compression_type != kCompressionZlib && h.compression_type != kCompressionZstd)
    return Status::errorf(ENOTSUP, "unknown qcow2 compression type {}", h.compression_type);
  bool bit = (h.incompatible_features & kIncompatCompression) != 0;
  if (h.compression_type == kCompressionZlib && bit)
    return invalid("compression type bit set with zlib compression");
  if (h.compression_type != kCompressionZlib && !bit)
    return invalid("compression type bit not set for zstd compression");
  return Status::ok();
}

Status check_geometry(const Header& h, uint64_t file_size) {
  if (h.refcount_order > kMaxRefcountOrder)
    return invalid(fmt::format("refcount_order {} (max {})", h.refcount_order, kMaxRefcountOrder));
  if (h.extended_l2() && h.cluster_bits < kMinExtendedL2ClusterBits)
    return invalid(fmt::format("extended L2 entries need clusters of at least 16 KiB (cluster_bits {})",
                               h.cluster_bits));
  if (uint64_t{h.l1_size} * kL1EntrySize > kMaxL1Bytes)
    return invalid(fmt::format("L1 table of {} entries is too large", h.l1_size));
  uint64_t needed = h.l1_entries_for(h.size);
  if (needed > kMaxL1Bytes / kL1EntrySize)
    return invalid(fmt::format("virtual size {} is too large for cluster size {}", h.size, h.cluster_size()));
  if (h.l1_size < needed)
    return invalid(fmt::format("L1 table of {} entries is too small for virtual size {}", h.l1_size, h.size));
  if (h.l1_size > 0)
    QCOWFS_TRY(check_table("L1 table", h.l1_table_offset, uint64_t{h.l1_size} * kL1EntrySize, h, file_size));
  if (h.refcount_table_clusters == 0) return invalid("image has no refcount table");
  uint64_t rt_bytes = uint64_t{h.refcount_table_clusters} << h.cluster_bits;
  if (rt_bytes > kMaxRefcountTableBytes)
    return invalid(fmt::format("refcount table of {} clusters is too large", h.refcount_table_clusters));
  QCOWFS_TRY(check_table("refcount table", h.refcount_table_offset, rt_bytes, h, file_size));
  if (h.nb_snapshots > kMaxSnapshots) return invalid(fmt::format("{} snapshots (max {})", h.nb_snapshots, kMaxSnapshots));
  if (h.nb_snapshots > 0)
    QCOWFS_TRY(check_table("snapshot table", h.snapshots_offset, sizeof(SnapshotHeaderLayout) * h.nb_snapshots, h,
                           file_size));
  return Status::ok();
}

bool ranges_overlap(uint64_t a, uint64_t alen, uint64_t b, uint64_t blen) {
  return alen > 0 && blen > 0 && a < b + blen && b < a + alen;
}

Status check_overlaps(const Header& h) {
  uint64_t l1_bytes = uint64_t{h.l1_size} * kL1EntrySize;
  uint64_t rt_bytes = uint64_t{h.refcount_table_clusters} << h.cluster_bits;
  if (ranges_overlap(h.l1_table_offset, l1_bytes, h.refcount_table_offset, rt_bytes))
    return invalid("L1 table overlaps the refcount table");
  if (h.nb_snapshots > 0) {
    uint64_t sn_bytes = sizeof(SnapshotHeaderLayout) * h.nb_snapshots;
    if (ranges_overlap(h.snapshots_offset, sn_bytes, h.l1_table_offset, l1_bytes) ||
        ranges_overlap(h.snapshots_offset, sn_bytes, h.refcount_table_offset, rt_bytes))
      return invalid("snapshot table overlaps the L1 or refcount table");
  }
  return Status::ok();
}

// The LUKS area (full disk encryption header extension): whole clusters
// inside the file, clear of the header cluster and the tables the header names.
Status check_crypto_area(const Header& h, uint64_t file_size) {
  if (h.crypt_method == kCryptLuks && !h.crypto)
    return invalid("LUKS encryption (crypt_method 2) without the encryption header extension");
  if (!h.crypto) return Status::ok();
  if (h.crypt_method != kCryptLuks) return invalid("encryption header extension without LUKS encryption");
  const uint64_t off = h.crypto->offset, len = h.crypto->length;
  if (len == 0 || (off & (h.cluster_size() - 1)) != 0 || !range_inside_file(off, len, h.cluster_size(), file_size))
    return invalid(fmt::format("LUKS area at {:#x} ({} bytes) is not whole clusters inside the file", off, len));
  const uint64_t l1_bytes = uint64_t{h.l1_size} * kL1EntrySize;
  const uint64_t rt_bytes = uint64_t{h.refcount_table_clusters} << h.cluster_bits;
  if (ranges_overlap(off, len, h.l1_table_offset, l1_bytes) || ranges_overlap(off, len, h.refcount_table_offset, rt_bytes) ||
      (h.nb_snapshots > 0 && ranges_overlap(off, len, h.snapshots_offset, sizeof(SnapshotHeaderLayout) * h.nb_snapshots)))
    return invalid(fmt::format("LUKS area at {:#x} ({} bytes) overlaps the L1, refcount or snapshot table", off, len));
  return Status::ok();
}

Status parse_feature_table(std::span<const std::byte> d, Header& h) {
  for (size_t at = 0; at + kFeatureNameEntrySize <= d.size(); at += kFeatureNameEntrySize) {
    FeatureName f;
    f.type = static_cast<FeatureType>(static_cast<uint8_t>(d[at + offsetof(FeatureNameLayout, type)]));
    f.bit = static_cast<uint8_t>(d[at + offsetof(FeatureNameLayout, bit)]);
    auto name = d.subspan(at + offsetof(FeatureNameLayout, name), kFeatureNameLength);
    f.name = bytes_to_string(name);
    f.name.resize(strnlen(f.name.c_str(), f.name.size()));
    h.feature_names.push_back(std::move(f));
  }
  return Status::ok();
}

Status parse_bitmaps(std::span<const std::byte> d, Header& h, uint64_t file_size) {
  if (d.size() != sizeof(BitmapsExtLayout))
    return invalid(fmt::format("bitmaps extension of {} bytes (expected {})", d.size(), sizeof(BitmapsExtLayout)));
  BitmapsExtension b;
  b.nb_bitmaps = load_be32(d.data() + offsetof(BitmapsExtLayout, nb_bitmaps));
  b.directory_size = load_be64(d.data() + offsetof(BitmapsExtLayout, bitmap_directory_size));
  b.directory_offset = load_be64(d.data() + offsetof(BitmapsExtLayout, bitmap_directory_offset));
  // Without the autoclear bit the extension is stale: kept, never interpreted.
  if (h.autoclear_features & kAutoclearBitmaps) {
    if (load_be32(d.data() + offsetof(BitmapsExtLayout, reserved)) != 0)
      return invalid("bitmaps extension reserved field is not zero");
    if (b.nb_bitmaps == 0 || b.nb_bitmaps > kMaxBitmaps)
      return invalid(fmt::format("bitmaps extension lists {} bitmaps", b.nb_bitmaps));
    if (b.directory_size > kMaxBitmapDirectorySize)
      return invalid(fmt::format("bitmap directory of {} bytes is too large", b.directory_size));
    QCOWFS_TRY(check_table("bitmap directory", b.directory_offset, b.directory_size, h, file_size));
  }
  h.bitmaps = b;
  return Status::ok();
}

Status parse_crypto(std::span<const std::byte> d, Header& h) {
  if (d.size() != sizeof(CryptoExtLayout))
    return invalid(fmt::format("encryption header extension of {} bytes (expected {})", d.size(),
                               sizeof(CryptoExtLayout)));
  h.crypto = CryptoExtension{load_be64(d.data() + offsetof(CryptoExtLayout, offset)),
                             load_be64(d.data() + offsetof(CryptoExtLayout, length))};
  return Status::ok();
}

Status parse_extension(uint32_t type, std::span<const std::byte> d, Header& h, uint64_t file_size) {
  switch (type) {
    case kExtBackingFormat:
      if (d.size() > kMaxFormatNameLength)
        return invalid(fmt::format("backing format name of {} bytes is too long", d.size()));
      h.backing_format = bytes_to_string(d);
      return Status::ok();
    case kExtFeatureTable:
      return parse_feature_table(d, h);
    case kExtBitmaps:
      return parse_bitmaps(d, h, file_size);
    case kExtCryptoHeader:
      return parse_crypto(d, h);
    case kExtDataFile:
      h.data_file = bytes_to_string(d);
      h.has_data_file_name = true;
      return Status::ok();
    default:
      h.unknown_extensions.push_back(UnknownExtension{type, std::vector<std::byte>(d.begin(), d.end())});
      return Status::ok();
  }
}

Status parse_extensions(std::span<const std::byte> b, Header& h, uint64_t file_size) {
  uint64_t at = h.header_length;
  uint64_t end = h.backing_file_offset != 0 ? std::min<uint64_t>(h.backing_file_offset, h.cluster_size())
                                            : h.cluster_size();
  while (at < end) {
    if (end - at < kExtHeaderSize) return invalid(fmt::format("truncated header extension at {:#x}", at));
    uint32_t type = load_be32(b.data() + at + offsetof(ExtHeaderLayout, type));
    uint32_t len = load_be32(b.data() + at + offsetof(ExtHeaderLayout, length));
    at += kExtHeaderSize;
    if (type == kExtEnd) return Status::ok();
    if (len > end - at)
      return invalid(fmt::format("header extension {:#x} of {} bytes runs past the header area", type, len));
    QCOWFS_TRY(parse_extension(type, b.subspan(at, len), h, file_size));
    at += align_up(len, kExtAlign);
  }
  return Status::ok();
}

Status parse_backing_name(std::span<const std::byte> b, Header& h) {
  if (h.backing_file_offset == 0) return Status::ok();
  uint64_t fixed_end = h.version == 2 ? kV2HeaderLength : h.header_length;
  if (h.backing_file_size > kMaxBackingNameLength)
    return invalid(fmt::format("backing file name of {} bytes (max {})", h.backing_file_size, kMaxBackingNameLength));
  if (h.backing_file_offset < fixed_end || h.backing_file_offset > h.cluster_size() ||
      h.backing_file_size > h.cluster_size() - h.backing_file_offset)
    return invalid(fmt::format("backing file name at {:#x} ({} bytes) is outside the header cluster",
                               h.backing_file_offset, h.backing_file_size));
  h.backing_file = bytes_to_string(b.subspan(h.backing_file_offset, h.backing_file_size));
  return Status::ok();
}

Status check_cluster_bits(uint32_t bits) {
  if (bits < kMinClusterBits || bits > kMaxClusterBits)
    return invalid(fmt::format("cluster_bits {} (must be {}..{})", bits, kMinClusterBits, kMaxClusterBits));
  return Status::ok();
}

std::string known_incompatible_name(unsigned bit) {
  switch (uint64_t{1} << bit) {
    case kIncompatDirty: return "dirty bit";
    case kIncompatCorrupt: return "corrupt bit";
    case kIncompatDataFile: return "external data file";
    case kIncompatCompression: return "compression type";
    case kIncompatExtendedL2: return "extended L2 entries";
    default: return fmt::format("unknown feature bit {}", bit);
  }
}

// ---- serialisation ----

void put_extension(std::vector<std::byte>& out, uint32_t type, std::span<const std::byte> data) {
  size_t at = out.size();
  out.resize(at + kExtHeaderSize + align_up(data.size(), kExtAlign));
  store_be32(out.data() + at + offsetof(ExtHeaderLayout, type), type);
  store_be32(out.data() + at + offsetof(ExtHeaderLayout, length), static_cast<uint32_t>(data.size()));
  if (!data.empty()) std::memcpy(out.data() + at + kExtHeaderSize, data.data(), data.size());
}

std::span<const std::byte> as_bytes(const std::string& s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

void put_fixed_fields(const Header& h, std::byte* p) {
  store_be32(p + offsetof(HeaderLayout, magic), kMagic);
  store_be32(p + offsetof(HeaderLayout, version), h.version);
  store_be64(p + offsetof(HeaderLayout, backing_file_offset), h.backing_file_offset);
  store_be32(p + offsetof(HeaderLayout, backing_file_size), h.backing_file_size);
  store_be32(p + offsetof(HeaderLayout, cluster_bits), h.cluster_bits);
  store_be64(p + offsetof(HeaderLayout, size), h.size);
  store_be32(p + offsetof(HeaderLayout, crypt_method), h.crypt_method);
  store_be32(p + offsetof(HeaderLayout, l1_size), h.l1_size);
  store_be64(p + offsetof(HeaderLayout, l1_table_offset), h.l1_table_offset);
  store_be64(p + offsetof(HeaderLayout, refcount_table_offset), h.refcount_table_offset);
  store_be32(p + offsetof(HeaderLayout, refcount_table_clusters), h.refcount_table_clusters);
  store_be32(p + offsetof(HeaderLayout, nb_snapshots), h.nb_snapshots);
  store_be64(p + offsetof(HeaderLayout, snapshots_offset), h.snapshots_offset);
  if (h.version == 2) return;
  store_be64(p + offsetof(HeaderLayout, incompatible_features), h.incompatible_features);
  store_be64(p + offsetof(HeaderLayout, compatible_features), h.compatible_features);
  store_be64(p + offsetof(HeaderLayout, autoclear_features), h.autoclear_features);
  store_be32(p + offsetof(HeaderLayout, refcount_order), h.refcount_order);
  store_be32(p + offsetof(HeaderLayout, header_length), h.header_length);
  if (h.header_length > offsetof(HeaderLayout, compression_type))
    p[offsetof(HeaderLayout, compression_type)] = std::byte{h.compression_type};
  size_t room = h.header_length > sizeof(HeaderLayout) ? h.header_length - sizeof(HeaderLayout) : 0;
  size_t n = std::min(room, h.unknown_header_fields.size());
  if (n > 0) std::memcpy(p + sizeof(HeaderLayout), h.unknown_header_fields.data(), n);  // data() may be null when empty
}

std::vector<std::byte> feature_table_bytes(const Header& h) {
  std::vector<std::byte> d(h.feature_names.size() * kFeatureNameEntrySize);
  for (size_t i = 0; i < h.feature_names.size(); ++i) {
    std::byte* e = d.data() + i * kFeatureNameEntrySize;
    const FeatureName& f = h.feature_names[i];
    e[offsetof(FeatureNameLayout, type)] = std::byte{static_cast<uint8_t>(f.type)};
    e[offsetof(FeatureNameLayout, bit)] = std::byte{f.bit};
    std::memcpy(e + offsetof(FeatureNameLayout, name), f.name.data(), std::min(f.name.size(), kFeatureNameLength));
  }
  return d;
}

std::vector<std::byte> extensions_bytes(const Header& h) {
  std::vector<std::byte> out;
  if (!h.backing_format.empty()) put_extension(out, kExtBackingFormat, as_bytes(h.backing_format));
  if (h.has_data_file_name) put_extension(out, kExtDataFile, as_bytes(h.data_file));
  if (h.crypto) {
    std::byte d[sizeof(CryptoExtLayout)];
    store_be64(d + offsetof(CryptoExtLayout, offset), h.crypto->offset);
    store_be64(d + offsetof(CryptoExtLayout, length), h.crypto->length);
    put_extension(out, kExtCryptoHeader, d);
  }
  if (!h.feature_names.empty()) put_extension(out, kExtFeatureTable, feature_table_bytes(h));
  if (h.bitmaps) {
    std::byte d[sizeof(BitmapsExtLayout)] = {};
    store_be32(d + offsetof(BitmapsExtLayout, nb_bitmaps), h.bitmaps->nb_bitmaps);
    store_be64(d + offsetof(BitmapsExtLayout, bitmap_directory_size), h.bitmaps->directory_size);
    store_be64(d + offsetof(BitmapsExtLayout, bitmap_directory_offset), h.bitmaps->directory_offset);
    put_extension(out, kExtBitmaps, d);
  }
  for (const auto& u : h.unknown_extensions) put_extension(out, u.type, u.data);
  put_extension(out, kExtEnd, {});
  return out;
}

}  // namespace

uint64_t Header::l1_entries_for(uint64_t guest_size) const {
  uint64_t per = bytes_per_l1_entry();
  return guest_size / per + (guest_size % per != 0 ? 1 : 0);
}

std::string Header::incompatible_feature_name(unsigned bit) const {
  for (const auto& f : feature_names)
    if (f.type == FeatureType::incompatible && f.bit == bit && !f.name.empty()) return f.name;
  return known_incompatible_name(bit);
}

Result<uint64_t> header_cluster_size(std::span<const std::byte> first) {
  if (first.size() < kV2HeaderLength) return Status::error(EINVAL, "not a qcow2 image: file too small");
  if (QCOW2_FIELD(first, magic) != kMagic) return Status::error(EINVAL, "not a qcow2 image: bad magic");
  uint32_t version = QCOW2_FIELD(first, version);
  if (version != 2 && version != 3) return Status::errorf(ENOTSUP, "unsupported qcow2 version {}", version);
  uint32_t bits = QCOW2_FIELD(first, cluster_bits);
  QCOWFS_TRY(check_cluster_bits(bits));
  return uint64_t{1} << bits;
}

bool range_inside_file(HostOffset host, uint64_t len, uint64_t cluster_size, uint64_t file_size) {
  return host >= cluster_size && host <= file_size && len <= file_size - host;
}

Result<Header> parse_header(std::span<const std::byte> b, uint64_t file_size) {
  auto cs = header_cluster_size(b);
  if (!cs) return cs.status();
  if (b.size() < *cs) return invalid(fmt::format("header buffer of {} bytes is shorter than a cluster", b.size()));
  Header h;
  h.cluster_bits = QCOW2_FIELD(b, cluster_bits);
  QCOWFS_TRY(parse_fixed_fields(b, h));
  QCOWFS_TRY(check_compression(h));
  QCOWFS_TRY(check_geometry(h, file_size));
  QCOWFS_TRY(check_overlaps(h));
  QCOWFS_TRY(parse_backing_name(b, h));
  QCOWFS_TRY(parse_extensions(b, h, file_size));
  QCOWFS_TRY(check_crypto_area(h, file_size));
  if (h.data_file_raw() && !h.has_external_data_file())
    return invalid("raw external data bit set without an external data file");
  if (h.has_external_data_file() && (!h.has_data_file_name || h.data_file.empty()))
    return Status::error(EINVAL, "qcow2 image uses an external data file but does not name it");
  return h;
}

Status check_features(const Header& h, bool writable) {
  if (h.crypt_method > kCryptLuks)
    return Status::errorf(ENOTSUP, "unknown qcow2 encryption method {} (1 is AES, 2 is LUKS)", h.crypt_method);
  if (h.crypt_method == kCryptAes && writable)
    return Status::error(EROFS, "qcow2's legacy AES encryption is weak and deprecated: such images open read-only "
                                "(convert the data to a LUKS-encrypted image to change it)");
  uint64_t unknown = h.incompatible_features & ~kIncompatKnown;
  if (unknown != 0) {
    std::string names;
    for (unsigned bit = 0; bit < 64; ++bit)
      if (unknown & (uint64_t{1} << bit))
        names += (names.empty() ? "" : ", ") + h.incompatible_feature_name(bit);
    return Status::errorf(ENOTSUP, "unsupported qcow2 feature(s): {}", names);
  }
  if (h.corrupt() && writable)
    return Status::error(EROFS, "qcow2 image is marked corrupt: it can only be opened read-only");
  return Status::ok();
}

Result<std::vector<std::byte>> serialize_header(const Header& h) {
  std::vector<std::byte> out(h.cluster_size());
  uint64_t fixed = h.version == 2 ? kV2HeaderLength : h.header_length;
  std::vector<std::byte> ext = extensions_bytes(h);
  uint64_t name_at = fixed + ext.size();
  if (name_at + h.backing_file.size() > out.size())
    return Status::error(EFBIG, "qcow2 header extensions and backing name do not fit in one cluster");
  Header copy = h;
  copy.backing_file_offset = h.backing_file.empty() ? 0 : name_at;
  copy.backing_file_size = static_cast<uint32_t>(h.backing_file.size());
  put_fixed_fields(copy, out.data());
  if (!ext.empty()) std::memcpy(out.data() + fixed, ext.data(), ext.size());
  if (!h.backing_file.empty()) std::memcpy(out.data() + name_at, h.backing_file.data(), h.backing_file.size());
  return out;
}

}  // namespace qcowfs::image::qcow2
