// libFuzzer target: the VMDK text descriptor parser (image/vmdk/descriptor.h)
// over arbitrary bytes, with invariants on what it returns.
// Input: a descriptor file's text (seeds: make_seeds.py vmdk_descriptor_seeds).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "image/vmdk/descriptor.h"

namespace v = qcowfs::image::vmdk;

namespace {

void check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz_vmdk_descriptor invariant broken: %s\n", what);
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  auto ex = v::descriptor_extents(text);
  if (ex) {
    check(ex->size() <= v::kMaxExtents, "too many extents");
    for (const v::DescriptorExtent& e : *ex) {
      check(e.sectors > 0, "extent of no sectors");
      check(!e.file.empty() && e.file.size() <= v::kMaxExtentName, "extent name size");
      check(e.flat_offset >= 0, "negative flat offset");
      check(e.file.find('"') == std::string::npos && e.file.find('\n') == std::string::npos, "name has a quote");
    }
  }
  auto ct = v::descriptor_create_type(text);
  if (ct) check(ct->size() <= v::kMaxCreateType, "create type too long");
  auto hint = v::descriptor_parent_hint(text);
  if (hint && *hint) check((*hint)->size() <= v::kMaxParentHint, "parent hint too long");
  (void)v::descriptor_cid(text, false);
  (void)v::descriptor_cid(text, true);
  auto d = v::parse_descriptor(text);
  if (d) check(ex && d->extents.size() == ex->size(), "parse_descriptor disagrees with descriptor_extents");
  return 0;
}
