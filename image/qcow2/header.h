// qcow2 header: the decoded first cluster of an image (fixed fields, header
// extensions, backing file name) and the pure functions that parse, validate
// and re-serialise it. Parsing never trusts the bytes: every field is checked
// against the file size and QEMU's implementation limits before anything is
// allocated from it. Unknown header extensions are kept verbatim so a writer
// can rewrite the header without losing them.
// Thread-safety: plain values and pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "image/qcow2/format.h"
#include "io/status.h"

namespace qcowfs::image::qcow2 {

struct FeatureName {
  FeatureType type = FeatureType::incompatible;
  uint8_t bit = 0;
  std::string name;
};

struct BitmapsExtension {
  uint32_t nb_bitmaps = 0;
  uint64_t directory_size = 0;
  uint64_t directory_offset = 0;
};

struct CryptoExtension {
  uint64_t offset = 0;
  uint64_t length = 0;
};

struct UnknownExtension {
  uint32_t type = 0;
  std::vector<std::byte> data;
};

struct Header {
  uint32_t version = 3;
  uint64_t backing_file_offset = 0;
  uint32_t backing_file_size = 0;
  uint32_t cluster_bits = 16;
  uint64_t size = 0;
  uint32_t crypt_method = kCryptNone;
  uint32_t l1_size = 0;
  uint64_t l1_table_offset = 0;
  uint64_t refcount_table_offset = 0;
  uint32_t refcount_table_clusters = 0;
  uint32_t nb_snapshots = 0;
  uint64_t snapshots_offset = 0;
  uint64_t incompatible_features = 0;
  uint64_t compatible_features = 0;
  uint64_t autoclear_features = 0;
  uint32_t refcount_order = kV2RefcountOrder;
  uint32_t header_length = kV3HeaderLength;
  uint8_t compression_type = kCompressionZlib;

  std::string backing_file;    // empty: no backing file
  std::string backing_format;  // from the backing format extension ("" if absent)
  std::string data_file;       // from the external data file name extension
  bool has_data_file_name = false;
  std::vector<FeatureName> feature_names;
  std::optional<BitmapsExtension> bitmaps;
  std::optional<CryptoExtension> crypto;
  std::vector<UnknownExtension> unknown_extensions;  // in file order
  // Header bytes past the fields this driver knows ([112, header_length)):
  // later additional fields, kept verbatim for rewriting.
  std::vector<std::byte> unknown_header_fields;

  uint64_t cluster_size() const { return uint64_t{1} << cluster_bits; }
  bool extended_l2() const { return (incompatible_features & kIncompatExtendedL2) != 0; }
  bool has_external_data_file() const { return (incompatible_features & kIncompatDataFile) != 0; }
  bool data_file_raw() const { return (autoclear_features & kAutoclearDataFileRaw) != 0; }
  bool dirty() const { return (incompatible_features & kIncompatDirty) != 0; }
  bool corrupt() const { return (incompatible_features & kIncompatCorrupt) != 0; }
  size_t l2_entry_size() const { return extended_l2() ? kExtendedL2EntrySize : kL2EntrySize; }
  uint64_t l2_entries() const { return cluster_size() / l2_entry_size(); }
  uint32_t refcount_bits() const { return 1u << refcount_order; }
  // Guest bytes one L1 entry covers.
  uint64_t bytes_per_l1_entry() const { return l2_entries() << cluster_bits; }
  // L1 entries needed to cover `guest_size` bytes with this geometry.
  uint64_t l1_entries_for(uint64_t guest_size) const;
  // Name of an incompatible feature bit: the image's feature name table first,
  // then the names this driver knows, else "unknown feature bit N".
  std::string incompatible_feature_name(unsigned bit) const;
};

// Bytes to read first: enough for header_cluster_size().
inline constexpr size_t kHeaderProbeBytes = sizeof(HeaderLayout);

// Validates magic, version and cluster_bits from the first bytes of a file and
// returns the cluster size, i.e. how many bytes parse_header() needs.
Result<uint64_t> header_cluster_size(std::span<const std::byte> first_bytes);

// Parses and validates the header cluster. `cluster0` holds the first cluster
// of the file (zero-filled past end of file); `file_size` is the image file's size.
Result<Header> parse_header(std::span<const std::byte> cluster0, uint64_t file_size);

// Refuses what this driver cannot open: unknown encryption methods, legacy
// AES opened writable, unknown incompatible features, a corrupt image opened
// writable. Messages name the feature.
Status check_features(const Header& h, bool writable);

// Whether [host, host + len) lies inside a file of file_size bytes and out of
// the header cluster (the bounds every metadata table must keep).
bool range_inside_file(HostOffset host, uint64_t len, uint64_t cluster_size, uint64_t file_size);

// Serialises h into one header cluster (fixed fields, extensions, backing file
// name). Fails when the extensions and name do not fit in the cluster.
Result<std::vector<std::byte>> serialize_header(const Header& h);

}  // namespace qcowfs::image::qcow2
