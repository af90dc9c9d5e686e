// The VMDK text descriptor ("# Disk DescriptorFile"): createType, the extent
// lines, CID, parentCID and parentFileNameHint, parsed as QEMU 7.2's
// block/vmdk.c does (vmdk_parse_description, vmdk_parse_extents,
// vmdk_read_cid, vmdk_parent_open): C-string semantics (the text ends at its
// first NUL), strstr() for the keys, sscanf()'s rules for extent lines. The
// text is untrusted: every function is bounded by its input and the limits
// below.
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "io/status.h"

namespace qcowfs::image::vmdk {

// Extent lines QEMU opens beyond this are refused (QEMU has no limit; each one
// opens a host file).
constexpr size_t kMaxExtents = 1024;
// QEMU's buffers: createType (128 with the NUL), a file name (511), the parent hint (PATH_MAX - 1).
constexpr size_t kMaxCreateType = 127;
constexpr size_t kMaxExtentName = 511;
constexpr size_t kMaxParentHint = 4095;

struct DescriptorExtent {
  std::string type;         // FLAT, SPARSE, VMFS, VMFSSPARSE, SESPARSE
  int64_t sectors = 0;      // > 0
  std::string file;         // as written: relative to the descriptor's directory unless absolute
  int64_t flat_offset = 0;  // FLAT, VMFS: sectors into the file (>= 0); others: 0
};

// The text as C sees it: up to the first NUL.
std::string_view c_string(std::string_view text);

// createType="...", checked against the types QEMU opens from a descriptor
// file (EINVAL when missing or too long, ENOTSUP for another type).
Result<std::string> descriptor_create_type(std::string_view text);

// The extent lines QEMU uses, in order: access RW, a positive size and a type
// it knows (other lines, ZERO and RDONLY extents among them, are skipped as
// QEMU skips them). A malformed line of a known type: EINVAL naming it.
Result<std::vector<DescriptorExtent>> descriptor_extents(std::string_view text);

// CID (parent = false) or parentCID (parent = true), hex, found with strstr()
// in the first kDescWindow - 1 bytes of the text; EINVAL when missing.
Result<uint32_t> descriptor_cid(std::string_view text, bool parent);

// parentFileNameHint="..." in the first kDescWindow bytes of the text;
// nullopt without one, EINVAL when unterminated or too long.
Result<std::optional<std::string>> descriptor_parent_hint(std::string_view text);

// The text with a new CID, as QEMU 7.2's vmdk_write_cid() edits it (on the
// first write of an open, so that deltas made on this image see that it
// changed): the text as C sees it in its first kDescWindow - 1 bytes, the
// first "CID" match followed by '=' and `cid` in lower-case hex and a newline,
// then the text from the first "parentCID" on. EINVAL without "parentCID" or
// "CID=".
Result<std::string> descriptor_with_cid(std::string_view text, uint32_t cid);

// A whole descriptor file: everything above.
struct Descriptor {
  std::string create_type;
  std::vector<DescriptorExtent> extents;
  uint32_t cid = 0;
  uint32_t parent_cid = 0;
  std::optional<std::string> parent_hint;
};
Result<Descriptor> parse_descriptor(std::string_view text);

}  // namespace qcowfs::image::vmdk
