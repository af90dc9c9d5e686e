#include "image/vmdk/map.h"

#include <endian.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "image/endian.h"
#include "image/vmdk/format.h"

namespace qcowfs::image::vmdk {
uint32_t VmdkMap::load_gte(const TableCache::Ref& ref, size_t at) {
  auto* p = reinterpret_cast<uint32_t*>(const_cast<std::byte*>(ref.bytes().data() + at));
  return le32toh(std::atomic_ref<uint32_t>(*p).load(std::memory_order_acquire));
}

void VmdkMap::store_gte(TableCache::Ref& ref, size_t at, uint32_t gte) {
  auto* p = reinterpret_cast<uint32_t*>(ref.mutable_bytes().data() + at);
  std::atomic_ref<uint32_t>(*p).store(htole32(gte), std::memory_order_release);
}

Status VmdkMap::decompress(const Extent& e, std::span<const std::byte> stream, std::span<std::byte> out) const {
  const VExtent& x = find_by_file(e);
  std::span<const std::byte> data = stream;
  uint64_t data_len = x.grain_bytes;
  if (x.markers) {
    data_len = load_le32(stream.data() + kMarkerSize);
    data = stream.subspan(kGrainMarkerHeader);
  }
  if (data_len == 0 || data_len > stream.size())
    return Status::errorf(EIO, "{}: compressed grain at {:#x} has a bad size {}", path_, e.host_offset, data_len);
  data_len = std::min<uint64_t>(data_len, data.size());
  std::vector<std::byte> tmp;
  std::byte* dst = out.data();
  if (out.size() < x.grain_bytes) {
    tmp.resize(x.grain_bytes);
    dst = tmp.data();
  }
  uLongf got = static_cast<uLongf>(x.grain_bytes);
  int z = ::uncompress(reinterpret_cast<Bytef*>(dst), &got, reinterpret_cast<const Bytef*>(data.data()),
                       static_cast<uLong>(data_len));
  if (z != Z_OK)
    return Status::errorf(EIO, "{}: compressed grain at {:#x} does not inflate (zlib {})", path_, e.host_offset, z);
  if (got < out.size())
    return Status::errorf(EIO, "{}: compressed grain at {:#x} inflates to {} bytes, fewer than {}", path_,
                          e.host_offset, got, out.size());
  if (!tmp.empty()) std::memcpy(out.data(), tmp.data(), out.size());
  return Status::ok();
}

std::unique_ptr<VmdkMap> make_map(std::string path, std::vector<VExtent> extents, std::vector<HostFileState> files) {
  return std::make_unique<VmdkMap>(std::move(path), std::move(extents), std::move(files));
}

}  // namespace qcowfs::image::vmdk
