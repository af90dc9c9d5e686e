// VHD footer and dynamic-disk header parsing: pure functions over the bytes
// (format.h has the layout), with QEMU 7.2's checks (block/vpc.c vpc_open).
// Thread-safety: pure functions.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "image/vpc/format.h"
#include "io/status.h"

namespace qcowfs::image::vpc {

struct Footer {
  uint32_t type = 0;
  uint64_t data_offset = 0;
  uint64_t current_size = 0;
  uint16_t cyls = 0;
  uint8_t heads = 0;
  uint8_t secs = 0;
  std::array<char, 4> creator_app{};
  // Fields only a new footer sets (serialize_footer); parse_footer leaves them.
  uint32_t creator_ver = 0;
  std::array<char, 4> creator_os{};
  uint64_t orig_size = 0;
  uint32_t timestamp = 0;
  std::array<uint8_t, 16> uuid{};
};

struct DynHeader {
  uint64_t table_offset = 0;
  uint32_t max_table_entries = 0;
  uint32_t block_size = 0;
};

// ~(sum of the bytes) with the checksum field counted as zeros.
uint32_t footer_checksum(std::span<const std::byte, kFooterSize> b);
uint32_t dyn_header_checksum(std::span<const std::byte, kDynHeaderSize> b);
bool has_cookie(std::span<const std::byte> b, std::string_view cookie);

// The footer in b (cookie and checksum checked; EINVAL naming path).
Result<Footer> parse_footer(std::span<const std::byte, kFooterSize> b, const std::string& path);

// The guest size in sectors as QEMU computes it: the CHS geometry, unless the
// creator application is one that sizes by current_size ("win ", "qem2",
// "d2v ", "CTXS", "tap\0") or the geometry is the maximum one. EFBIG past
// 2040 GiB.
Result<uint64_t> virtual_sectors(const Footer& f, const std::string& path);

// The dynamic-disk header in b (cookie, block size and table size checked
// against a disk of `sectors`).
Result<DynHeader> parse_dyn_header(std::span<const std::byte, kDynHeaderSize> b, uint64_t sectors,
                                   const std::string& path);

// A footer's bytes (cookie, features, version, f's fields, checksum), as
// QEMU's vpc_co_create() writes them.
std::array<std::byte, kFooterSize> serialize_footer(const Footer& f);

// A dynamic-disk header's bytes (cookie, data_offset all ones, version, h's
// fields, checksum), as QEMU's create_dynamic_disk() writes them.
std::array<std::byte, kDynHeaderSize> serialize_dyn_header(const DynHeader& h);

}  // namespace qcowfs::image::vpc
