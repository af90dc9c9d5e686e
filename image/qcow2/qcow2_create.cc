#include "image/qcow2/qcow2_create.h"

#include "image/create.h"

#include <algorithm>
#include <bit>
#include <charconv>
#include <vector>

#include "image/endian.h"
#include "image/qcow2/qcow2_inspect.h"
#include "image/qcow2/refcount.h"
#include "io/align.h"
#include "io/buffer.h"

namespace qcowfs::image::qcow2 {
namespace {

constexpr uint64_t kMinExtendedL2ClusterSize = uint64_t{1} << kMinExtendedL2ClusterBits;
constexpr uint32_t kV2RefcountBits = 1u << kV2RefcountOrder;
constexpr uint32_t kMaxRefcountBits = 1u << kMaxRefcountOrder;
constexpr size_t kZeroChunk = 1 << 20;

// The bit number of a one-bit feature mask.
constexpr uint8_t bit_of(uint64_t mask) { return static_cast<uint8_t>(std::countr_zero(mask)); }

Status bad_value(std::string_view key, std::string_view value, std::string_view expected) {
  return Status::errorf(EINVAL, "bad value '{}' for option {} (expected {})", value, key, expected);
}

// Bools and sizes as every format's create options parse them (image/create.h).
Result<bool> parse_bool(std::string_view key, std::string_view v) { return parse_create_bool(key, v); }
Result<uint64_t> parse_size_value(std::string_view key, std::string_view v) { return parse_create_size(key, v); }

Result<Preallocation> parse_prealloc(std::string_view v) {
  if (v == "off") return Preallocation::off;
  if (v == "metadata") return Preallocation::metadata;
  if (v == "falloc") return Preallocation::falloc;
  if (v == "full") return Preallocation::full;
  return bad_value("preallocation", v, "off, metadata, falloc or full");
}

// ---- one create option each ----

Status apply_size_option(CreateOptions& o, std::string_view key, std::string_view v) {
  auto n = parse_size_value(key, v);
  if (!n) return n.status();
  if (key == "size") {
    o.size = *n;
    o.size_given = true;
  } else {
    o.cluster_size = *n;
  }
  return Status::ok();
}

Status apply_bool_option(CreateOptions& o, std::string_view key, std::string_view v) {
  auto b = parse_bool(key, v);
  if (!b) return b.status();
  (key == "lazy_refcounts" ? o.lazy_refcounts : key == "extended_l2" ? o.extended_l2 : o.data_file_raw) = *b;
  return Status::ok();
}

Status apply_compat(CreateOptions& o, std::string_view v) {
  if (v == "0.10" || v == "v2") o.compat_v2 = true;
  else if (v == "1.1" || v == "v3") o.compat_v2 = false;
  else return bad_value("compat", v, "0.10 or 1.1");
  return Status::ok();
}

Status apply_refcount_bits(CreateOptions& o, std::string_view v) {
  uint32_t n = 0;
  auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
  if (ec != std::errc() || end != v.data() + v.size()) return bad_value("refcount_bits", v, "1, 2, 4, 8, 16, 32 or 64");
  o.refcount_bits = n;
  return Status::ok();
}

Status apply_compression_type(CreateOptions& o, std::string_view v) {
  if (v == "zlib") o.compression_type = kCompressionZlib;
  else if (v == "zstd") o.compression_type = kCompressionZstd;
  else return bad_value("compression_type", v, "zlib or zstd");
  return Status::ok();
}

Status check_numbers(const CreateOptions& o) {
  if (!is_pow2(o.cluster_size) || o.cluster_size < (uint64_t{1} << kMinClusterBits) ||
      o.cluster_size > (uint64_t{1} << kMaxClusterBits))
    return Status::errorf(EINVAL, "cluster size must be a power of two between {} and {} bytes",
                          uint64_t{1} << kMinClusterBits, uint64_t{1} << kMaxClusterBits);
  if (!is_pow2(o.refcount_bits) || o.refcount_bits > kMaxRefcountBits)
    return Status::error(EINVAL, "refcount width must be a power of two and may not exceed 64 bits");
  return Status::ok();
}

Status check_v2_compatible(const CreateOptions& o) {
  if (!o.compat_v2) return Status::ok();
  if (o.refcount_bits != kV2RefcountBits) return Status::error(EINVAL, "different refcount widths than 16 bits require compatibility level 1.1 or above (use compat=1.1 or greater)");
  if (o.lazy_refcounts) return Status::error(EINVAL, "lazy refcounts only supported with compatibility level 1.1 and above (use compat=1.1 or greater)");
  if (o.extended_l2) return Status::error(EINVAL, "extended L2 entries are only supported with compatibility level 1.1 and above (use compat=1.1 or greater)");
  if (!o.data_file.empty()) return Status::error(EINVAL, "external data files are only supported with compatibility level 1.1 and above");
  if (o.compression_type != kCompressionZlib)
    return Status::error(EINVAL, "non-zlib compression type is only supported with compatibility level 1.1 and above (use compat=1.1 or greater)");
  return Status::ok();
}

Status check_combinations(const CreateOptions& o) {
  if (o.extended_l2 && o.cluster_size < kMinExtendedL2ClusterSize)
    return Status::errorf(EINVAL, "extended L2 entries are only supported with cluster sizes of at least {} bytes",
                          kMinExtendedL2ClusterSize);
  if (o.data_file_raw && o.data_file.empty()) return Status::error(EINVAL, "data_file_raw requires data_file");
  if (o.data_file_raw && !o.backing_file.empty())
    return Status::error(EINVAL, "backing file and data_file_raw cannot be used at the same time");
  if (!o.backing_file.empty() && o.preallocation != Preallocation::off && !o.extended_l2)
    return Status::error(EINVAL, "backing file and preallocation can only be used at the same time if extended_l2 is on");
  if (!o.backing_format.empty() && o.backing_file.empty())
    return Status::error(EINVAL, "backing_fmt needs a backing file");
  if (o.backing_format.size() > kMaxFormatNameLength) return Status::error(EINVAL, "backing format name is too long");
  if (o.backing_file.size() > kMaxBackingNameLength) return Status::error(EINVAL, "backing file name is too long");
  if (!o.size_given && o.backing_file.empty()) return Status::error(EINVAL, "image size must be given (no backing file to take it from)");
  return Status::ok();
}

// encryption=on (QEMU's old spelling) and encrypt.format=aes make legacy AES
// images, which are refused; encrypt.format=luks and the encrypt.* LUKS options.
Status apply_encrypt_option(CreateOptions& o, std::string_view key, std::string_view v) {
  constexpr std::string_view kNoAes =
      "legacy qcow2 AES encryption is weak (QEMU deprecates it) and qcowfs only reads it: use encrypt.format=luks";
  if (key == "encryption") {
    auto b = parse_bool(key, v);
    if (!b) return b.status();
    if (*b) return Status::errorf(EINVAL, "encryption=on: {}", kNoAes);
    return Status::ok();
  }
  std::string_view name = key.substr(std::string_view("encrypt.").size());
  if (name == "format") {
    if (v == "aes") return Status::errorf(EINVAL, "encrypt.format=aes: {}", kNoAes);
    if (v != "luks") return bad_value(key, v, "luks");
    o.encrypt = true;
    return Status::ok();
  }
  if (!is_luks_create_option(name)) return Status::errorf(EINVAL, "unknown create option '{}'", key);
  o.encrypt_options_given = true;
  return apply_luks_create_option(o.luks, name, v, "encrypt.");
}

Status check_encryption(const CreateOptions& o) {
  if (o.encrypt_options_given && !o.encrypt)
    return Status::error(EINVAL, "Parameter 'encrypt.format' is missing (encrypt.* options need encrypt.format=luks)");
  // QEMU 7.2 allows it, but its preallocated clusters decrypt to noise (qemu-img map: data, not zero).
  if (o.encrypt && o.preallocation != Preallocation::off)
    return Status::errorf(EINVAL,
                          "preallocation={} cannot be used with encryption (preallocated clusters would read as "
                          "noise, not zeros)",
                          to_string(o.preallocation));
  return Status::ok();
}

// Feature names QEMU writes into every v3 image's feature name table.
std::vector<FeatureName> feature_name_table() {
  return {
      {FeatureType::incompatible, bit_of(kIncompatDirty), "dirty bit"},
      {FeatureType::incompatible, bit_of(kIncompatCorrupt), "corrupt bit"},
      {FeatureType::incompatible, bit_of(kIncompatDataFile), "external data file"},
      {FeatureType::incompatible, bit_of(kIncompatCompression), "compression type"},
      {FeatureType::incompatible, bit_of(kIncompatExtendedL2), "extended L2 entries"},
      {FeatureType::compatible, bit_of(kCompatLazyRefcounts), "lazy refcounts"},
      {FeatureType::autoclear, bit_of(kAutoclearBitmaps), "bitmaps"},
      {FeatureType::autoclear, bit_of(kAutoclearDataFileRaw), "raw external data"},
  };
}

// Cluster counts of the layout described in the header comment (host
// clusters: the header, the reftable, its blocks, L1, L2 tables, data).
struct Layout {
  uint64_t reftable_clusters = 0;
  uint64_t refblocks = 0;
  uint64_t l1_clusters = 0;
  uint64_t luks_clusters = 0;  // the LUKS area (encrypted images)
  uint64_t l2_tables = 0;
  uint64_t data_clusters = 0;  // in the image file

  HostCluster reftable_at() const { return 1; }
  HostCluster refblocks_at() const { return reftable_at() + reftable_clusters; }
  HostCluster l1_at() const { return refblocks_at() + refblocks; }
  HostCluster luks_at() const { return l1_at() + l1_clusters; }
  HostCluster l2_at() const { return luks_at() + luks_clusters; }
  HostCluster data_at() const { return l2_at() + l2_tables; }
  uint64_t total() const { return data_at() + data_clusters; }
};

Result<Layout> plan_layout(const Header& h, const CreateOptions& o, uint64_t luks_bytes) {
  uint64_t cs = h.cluster_size();
  Layout l;
  l.l1_clusters = div_round_up(uint64_t{h.l1_size} * kL1EntrySize, cs);
  l.luks_clusters = div_round_up(luks_bytes, cs);
  if (o.preallocation != Preallocation::off) {
    l.l2_tables = h.l1_size;
    if (o.data_file.empty()) l.data_clusters = div_round_up(h.size, cs);
  }
  const RefcountMap map(h.cluster_bits, h.refcount_order);
  for (;;) {
    uint64_t blocks = map.blocks_for(l.total());
    uint64_t table = std::max<uint64_t>(1, map.table_clusters_for(blocks));
    if (blocks == l.refblocks && table == l.reftable_clusters) break;
    l.refblocks = blocks;
    l.reftable_clusters = table;
  }
  if (l.reftable_clusters * cs > kMaxRefcountTableBytes)
    return Status::error(EFBIG, "image would need a refcount table larger than QEMU's limit");
  return l;
}

// Every cluster of the layout has refcount 1.
Task<Status> write_refcounts(io::HostFile& f, const Header& h, const Layout& l) {
  const uint64_t cs = h.cluster_size();
  const RefcountMap map(h.cluster_bits, h.refcount_order);
  std::vector<uint64_t> table;
  for (uint64_t b = 0; b < l.refblocks; ++b) {
    io::AlignedBuffer block(static_cast<size_t>(cs), f.mem_align());
    const HostCluster first_hc = b * map.block_entries();
    const HostCluster end_hc = std::min(first_hc + map.block_entries(), l.total());
    for (HostCluster hc = first_hc; hc < end_hc; ++hc) map.set(block.span(), hc, 1);
    HostOffset host = (l.refblocks_at() + b) * cs;
    QCOWFS_CO_TRY(co_await f.write(host, block.span()));
    table.push_back(host);
  }
  io::AlignedBuffer bytes = serialize_reftable(table, static_cast<size_t>(l.reftable_clusters * cs), f.mem_align());
  co_return co_await f.write(l.reftable_at() * cs, bytes.span());
}

// L2 entry of a preallocated cluster at host offset `host` (flags as QEMU sets them).
void put_prealloc_entry(const Header& h, std::byte* p, uint64_t host) {
  store_be64(p, host | kOflagCopied);
  // Subclusters unallocated: zeros or the backing file show.
  if (h.extended_l2()) store_be64(p + kExtendedL2BitmapOffset, 0);
}

Task<Status> write_l1_and_l2(io::HostFile& f, const Header& h, const Layout& l, bool external_data) {
  uint64_t cs = h.cluster_size();
  io::AlignedBuffer l1(static_cast<size_t>(l.l1_clusters * cs), f.mem_align());
  uint64_t clusters = div_round_up(h.size, cs);
  for (uint64_t t = 0; t < l.l2_tables; ++t) {
    io::AlignedBuffer l2(static_cast<size_t>(cs), f.mem_align());
    for (uint64_t i = 0; i < h.l2_entries(); ++i) {
      GuestCluster gc = t * h.l2_entries() + i;
      if (gc >= clusters) break;
      HostOffset host = external_data ? gc * cs : (l.data_at() + gc) * cs;
      put_prealloc_entry(h, l2.data() + i * h.l2_entry_size(), host);
    }
    HostOffset l2_host = (l.l2_at() + t) * cs;
    QCOWFS_CO_TRY(co_await f.write(l2_host, l2.span()));
    store_be64(l1.data() + t * kL1EntrySize, l2_host | kOflagCopied);
  }
  if (l.l1_clusters == 0) co_return Status::ok();
  co_return co_await f.write(l.l1_at() * cs, l1.span());
}

// Gives [host, host+len) of a file its final allocation per the preallocation mode.
Task<Status> preallocate_range(io::HostFile& f, HostOffset host, uint64_t len, Preallocation p) {
  if (p == Preallocation::falloc) co_return co_await f.write_zeroes(host, len);
  if (p == Preallocation::full) {
    io::AlignedBuffer zeros(kZeroChunk, f.mem_align());
    for (uint64_t done = 0; done < len;) {
      size_t n = static_cast<size_t>(std::min<uint64_t>(kZeroChunk, len - done));
      QCOWFS_CO_TRY(co_await f.write(host + done, zeros.span().first(n)));
      done += n;
    }
  }
  co_return Status::ok();
}

Task<Status> size_files(io::HostFile& file, io::HostFile* data_file, const Header& h, const Layout& l,
                        const CreateOptions& o) {
  uint64_t cs = h.cluster_size();
  if (data_file) {
    // The data file always spans the disk (sparse unless preallocated), as QEMU makes it.
    QCOWFS_CO_TRY(co_await data_file->truncate(h.size));
    QCOWFS_CO_TRY(co_await preallocate_range(*data_file, 0, h.size, o.preallocation));
    QCOWFS_CO_TRY(co_await data_file->flush());
  }
  uint64_t end = l.total() * cs;
  if (file.size() < end) QCOWFS_CO_TRY(co_await file.truncate(end));
  if (l.data_clusters != 0)
    QCOWFS_CO_TRY(co_await preallocate_range(file, l.data_at() * cs, l.data_clusters * cs, o.preallocation));
  co_return co_await file.flush();
}

}  // namespace

std::string_view to_string(Preallocation p) {
  switch (p) {
    case Preallocation::off: return "off";
    case Preallocation::metadata: return "metadata";
    case Preallocation::falloc: return "falloc";
    case Preallocation::full: return "full";
  }
  return "off";
}

Status apply_create_option(CreateOptions& o, std::string_view key, std::string_view v) {
  if (key == "size" || key == "cluster_size") return apply_size_option(o, key, v);
  if (key == "lazy_refcounts" || key == "extended_l2" || key == "data_file_raw") return apply_bool_option(o, key, v);
  if (key == "data_file" || key == "backing_file" || key == "backing_fmt") {
    (key == "data_file" ? o.data_file : key == "backing_file" ? o.backing_file : o.backing_format) = std::string(v);
    return Status::ok();
  }
  if (key == "compat") return apply_compat(o, v);
  if (key == "refcount_bits") return apply_refcount_bits(o, v);
  if (key == "compression_type") return apply_compression_type(o, v);
  if (key == "preallocation") {
    auto p = parse_prealloc(v);
    if (!p) return p.status();
    o.preallocation = *p;
    return Status::ok();
  }
  if (key == "encryption" || key.starts_with("encrypt.")) return apply_encrypt_option(o, key, v);
  return Status::errorf(EINVAL, "unknown create option '{}'", key);
}

Status apply_create_options(CreateOptions& o, std::string_view list) {
  while (!list.empty()) {
    size_t comma = list.find(',');
    std::string_view opt = list.substr(0, comma);
    size_t eq = opt.find('=');
    if (eq == std::string_view::npos) return Status::errorf(EINVAL, "option '{}' needs a value (key=value)", opt);
    QCOWFS_TRY(apply_create_option(o, opt.substr(0, eq), opt.substr(eq + 1)));
    if (comma == std::string_view::npos) break;
    list.remove_prefix(comma + 1);
  }
  return Status::ok();
}

Result<CreateOptions> validate_create_options(CreateOptions o) {
  QCOWFS_TRY(check_numbers(o));
  QCOWFS_TRY(check_v2_compatible(o));
  QCOWFS_TRY(check_combinations(o));
  QCOWFS_TRY(check_encryption(o));
  o.size = align_up(o.size, kSectorSize);
  // A raw data file is a complete raw image of the disk: it is full size and
  // every cluster maps onto it.
  if (o.data_file_raw && o.preallocation == Preallocation::off) o.preallocation = Preallocation::metadata;
  Header h = create_header(o);
  if (h.l1_entries_for(o.size) * kL1EntrySize > kMaxL1Bytes) return Status::error(EFBIG, "image size is too large for this cluster size");
  return o;
}

Header create_header(const CreateOptions& o) {
  Header h;
  h.version = o.compat_v2 ? 2 : 3;
  h.header_length = o.compat_v2 ? kV2HeaderLength : kV3HeaderLength;
  h.cluster_bits = static_cast<uint32_t>(std::countr_zero(o.cluster_size));
  h.size = o.size;
  h.refcount_order = static_cast<uint32_t>(std::countr_zero(o.refcount_bits));
  h.compression_type = o.compression_type;
  if (o.compression_type != kCompressionZlib) h.incompatible_features |= kIncompatCompression;
  if (o.extended_l2) h.incompatible_features |= kIncompatExtendedL2;
  if (!o.data_file.empty()) {
    h.incompatible_features |= kIncompatDataFile;
    h.data_file = o.data_file;
    h.has_data_file_name = true;
  }
  if (o.data_file_raw) h.autoclear_features |= kAutoclearDataFileRaw;
  if (o.lazy_refcounts) h.compatible_features |= kCompatLazyRefcounts;
  if (o.encrypt) h.crypt_method = kCryptLuks;
  h.backing_file = o.backing_file;
  h.backing_format = o.backing_format;
  if (!o.compat_v2) h.feature_names = feature_name_table();
  h.l1_size = static_cast<uint32_t>(h.l1_entries_for(o.size));
  return h;
}

// The LUKS area in its clusters, zero-filled to the end of the last one (as
// QEMU's qcow2_crypto_hdr_init_func writes zeros over them first).
Task<Status> write_luks_area(io::HostFile& f, const Header& h, const Layout& l, std::span<const std::byte> area) {
  if (area.empty()) co_return Status::ok();
  io::AlignedBuffer buf(static_cast<size_t>(l.luks_clusters * h.cluster_size()), f.mem_align());
  std::copy(area.begin(), area.end(), buf.data());
  co_return co_await f.write(l.luks_at() * h.cluster_size(), buf.span());
}

Task<Status> write_new_image(io::HostFile& file, io::HostFile* data_file, const CreateOptions& o,
                             std::span<const std::byte> luks_area) {
  if (o.encrypt == luks_area.empty())
    co_return Status::error(EINVAL, o.encrypt ? "an encrypted image needs its LUKS header"
                                              : "a LUKS header was given for an image without encryption");
  Header h = create_header(o);
  auto layout = plan_layout(h, o, luks_area.size());
  if (!layout) co_return layout.status();
  uint64_t cs = h.cluster_size();
  h.refcount_table_offset = layout->reftable_at() * cs;
  h.refcount_table_clusters = static_cast<uint32_t>(layout->reftable_clusters);
  h.l1_table_offset = h.l1_size ? layout->l1_at() * cs : 0;
  if (o.encrypt) h.crypto = CryptoExtension{layout->luks_at() * cs, luks_area.size()};
  auto header = serialize_header(h);
  // A 512-byte cluster has no room for both the feature name table and the crypto header extension:
  // QEMU's encrypted images with 512-byte clusters have no feature name table either.
  if (!header && h.crypto && !h.feature_names.empty()) {
    h.feature_names.clear();
    header = serialize_header(h);
  }
  if (!header) co_return header.status();
  QCOWFS_CO_TRY(co_await write_refcounts(file, h, *layout));
  QCOWFS_CO_TRY(co_await write_l1_and_l2(file, h, *layout, data_file != nullptr));
  QCOWFS_CO_TRY(co_await write_luks_area(file, h, *layout, luks_area));
  QCOWFS_CO_TRY(co_await size_files(file, data_file, h, *layout, o));
  // The header goes last: until it is written the file is not a qcow2 image.
  io::AlignedBuffer hbuf(header->size(), file.mem_align());
  std::copy(header->begin(), header->end(), hbuf.data());
  QCOWFS_CO_TRY(co_await file.write(0, hbuf.span()));
  co_return co_await file.flush();
}

}  // namespace qcowfs::image::qcow2
