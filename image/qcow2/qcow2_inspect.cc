#include "image/qcow2/qcow2_inspect.h"

#include <algorithm>
#include <cstring>

#include "image/endian.h"
#include "io/align.h"

namespace qcowfs::image::qcow2 {
namespace {

// Bytes of the snapshot table read first; the parser says when it needs more.
constexpr uint64_t kSnapshotTableFirstRead = 64 * 1024;

}  // namespace

Task<Result<Header>> read_qcow2_header(io::HostFile& f) {
  io::AlignedBuffer probe(kHeaderProbeBytes, f.mem_align());
  QCOWFS_CO_TRY(co_await read_padded(f, 0, probe.span()));
  auto cs = header_cluster_size(probe.span().first(std::min<uint64_t>(f.size(), kHeaderProbeBytes)));
  if (!cs) co_return cs.status();
  io::AlignedBuffer cluster0(static_cast<size_t>(*cs), f.mem_align());
  QCOWFS_CO_TRY(co_await read_padded(f, 0, cluster0.span()));
  co_return parse_header(cluster0.span(), f.size());
}

Task<Result<SnapshotTable>> read_qcow2_snapshots(io::HostFile& f, const Header& h) {
  if (h.nb_snapshots == 0) co_return SnapshotTable{};
  uint64_t room = f.size() - std::min(f.size(), h.snapshots_offset);
  uint64_t want = std::min<uint64_t>(kSnapshotTableFirstRead, room);
  for (;;) {
    io::AlignedBuffer buf(static_cast<size_t>(want), f.mem_align());
    QCOWFS_CO_TRY(co_await read_padded(f, h.snapshots_offset, buf.span()));
    auto t = parse_snapshot_table(buf.span(), h, f.size());
    if (!t || t->needed_bytes == 0) co_return t;
    want = std::min(std::max(t->needed_bytes, want * 2), std::min(kMaxSnapshotTableBytes, room));
  }
}

Result<std::vector<Bitmap>> parse_bitmap_directory(std::span<const std::byte> dir, uint32_t nb_bitmaps) {
  std::vector<Bitmap> out;
  uint64_t pos = 0;
  for (uint32_t i = 0; i < nb_bitmaps; ++i) {
    pos = align_up(pos, kBitmapDirEntryAlign);
    if (pos + sizeof(BitmapDirEntryLayout) > dir.size())
      return Status::errorf(EINVAL, "bitmap directory entry {} runs past the directory", i);
    const std::byte* p = dir.data() + pos;
    Bitmap b;
    b.table_offset = load_be64(p + offsetof(BitmapDirEntryLayout, bitmap_table_offset));
    b.table_size = load_be32(p + offsetof(BitmapDirEntryLayout, bitmap_table_size));
    b.flags = load_be32(p + offsetof(BitmapDirEntryLayout, flags));
    b.granularity_bits = static_cast<uint8_t>(p[offsetof(BitmapDirEntryLayout, granularity_bits)]);
    uint16_t name_size = load_be16(p + offsetof(BitmapDirEntryLayout, name_size));
    uint32_t extra = load_be32(p + offsetof(BitmapDirEntryLayout, extra_data_size));
    uint64_t entry = sizeof(BitmapDirEntryLayout) + uint64_t{extra} + name_size;
    if (pos + entry > dir.size()) return Status::errorf(EINVAL, "bitmap directory entry {} runs past the directory", i);
    b.name.assign(reinterpret_cast<const char*>(p + sizeof(BitmapDirEntryLayout) + extra), name_size);
    out.push_back(std::move(b));
    pos += entry;
  }
  return out;
}

Task<Result<std::vector<Bitmap>>> read_qcow2_bitmaps(io::HostFile& f, const Header& h) {
  if (!h.bitmaps || !(h.autoclear_features & kAutoclearBitmaps) || h.bitmaps->nb_bitmaps == 0)
    co_return std::vector<Bitmap>{};
  if (h.bitmaps->directory_size > kMaxBitmapDirectorySize)
    co_return Status::errorf(EINVAL, "bitmap directory of {} bytes is too large", h.bitmaps->directory_size);
  io::AlignedBuffer dir(static_cast<size_t>(h.bitmaps->directory_size), f.mem_align());
  QCOWFS_CO_TRY(co_await read_padded(f, h.bitmaps->directory_offset, dir.span()));
  co_return parse_bitmap_directory(dir.span(), h.bitmaps->nb_bitmaps);
}

}  // namespace qcowfs::image::qcow2
