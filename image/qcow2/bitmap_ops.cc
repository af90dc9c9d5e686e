// `qcowfs bitmap` on a qcow2 image (image/qcow2/qcow2_bitmap.h): the image is
// opened read-write through the driver, as qemu-img bitmap opens it (the
// bitmaps loaded and marked in use), the actions change the writer's
// PersistentBitmaps in memory, and closing stores them (writer_bitmaps.cc).
// Messages are QEMU 7.2's (blockdev/block-dirty-bitmap.c, block/dirty-bitmap.c).
#include <algorithm>
#include <bit>

#include "image/qcow2/bitmaps.h"
#include "image/qcow2/driver.h"
#include "image/qcow2/qcow2.h"
#include "image/qcow2/qcow2_bitmap.h"
#include "image/qcow2/qcow2_inspect.h"
#include "image/qcow2/writer.h"

namespace qcowfs::image {
namespace {

using qcow2::DirtyBitmap;
using qcow2::PersistentBitmaps;

// QEMU's bdrv_get_default_bitmap_granularity: the cluster size within [4 KiB, 64 KiB].
uint64_t default_bitmap_granularity(uint64_t cluster_size) {
  return std::min<uint64_t>(65536, std::max<uint64_t>(4096, cluster_size));
}

DirtyBitmap bitmap_from_bits(const BitmapBits& b) {
  DirtyBitmap d(b.disk_size, static_cast<uint32_t>(std::countr_zero(b.granularity)));
  for (const auto& [off, len] : b.dirty) d.set(off, len);
  return d;
}

Status merge_into(PersistentBitmaps& bm, const std::string& dst, const DirtyBitmap& src, uint64_t disk_size) {
  if (src.disk_size() != disk_size) return Status::error(EINVAL, "Bitmaps are incompatible and can't be merged");
  return bm.merge(dst, src);
}

Status run_bitmap_action(PersistentBitmaps& bm, const BitmapRequest& req, const BitmapAction& act, size_t& next_source,
                  const qcow2::Header& h) {
  const std::string& name = req.bitmap;
  switch (act.kind) {
    case BitmapActionKind::add: {
      if (name.empty()) return Status::error(EINVAL, "Bitmap name cannot be empty");
      const uint64_t g = req.granularity != 0 ? req.granularity : default_bitmap_granularity(h.cluster_size());
      if (g < 512 || (g & (g - 1)) != 0) return Status::error(EINVAL, "Granularity must be power of 2 and at least 512");
      return bm.add(name, g, true, h.size, h.cluster_bits);
    }
    case BitmapActionKind::remove: return bm.remove(name);
    case BitmapActionKind::clear: return bm.clear(name);
    case BitmapActionKind::enable: return bm.set_enabled(name, true);
    case BitmapActionKind::disable: return bm.set_enabled(name, false);
    case BitmapActionKind::merge: {
      if (next_source < req.merge_sources.size())
        return merge_into(bm, name, bitmap_from_bits(req.merge_sources[next_source++]), h.size);
      auto src = bm.bits_of(act.source);
      if (!src) return src.status();
      return merge_into(bm, name, *src, h.size);
    }
  }
  return Status::ok();
}

Task<Status> run_bitmap_ops(std::unique_ptr<io::HostFile> file, std::string path, BitmapRequest req) {
  ImageOptions opts;
  opts.format = "qcow2";
  opts.file.writable = true;
  opts.no_backing = true;  // metadata only: the backing file is never read
  opts.keys = req.keys;
  auto drv = co_await open_qcow2(std::move(file), path, opts);
  if (!drv) co_return drv.status();
  auto* q = static_cast<qcow2::Qcow2Driver*>(drv->get());
  qcow2::Qcow2Writer* w = q->writer();
  if (!w) co_return Status::error(EROFS, "the image was not opened read-write");
  if (q->image().header.version < 3)
    co_return Status::errorf(EINVAL, "Operation {} on bitmap {} failed: Cannot store dirty bitmaps in qcow2 v2 files",
                             bitmap_action_name(req.actions.front().kind), req.bitmap);
  Status st = co_await w->prepare_for_change();
  size_t next_source = 0;
  for (const BitmapAction& act : req.actions) {
    if (!st) break;
    if (act.kind == BitmapActionKind::remove) co_await w->adopt_bitmap_table(req.bitmap);
    st = run_bitmap_action(w->bitmaps(), req, act, next_source, q->image().header);
    if (!st)
      st = Status::errorf(st.code(), "Operation {} on bitmap {} failed: {}", bitmap_action_name(act.kind), req.bitmap,
                          st.message());
  }
  Status closed = co_await (*drv)->close();
  co_return st ? closed : st;
}

Task<Result<BitmapBits>> read_bitmap(std::unique_ptr<io::HostFile> file, std::string path, std::string name) {
  auto h = co_await qcow2::read_qcow2_header(*file);
  if (!h) co_return h.status().with_context(path);
  auto bm = co_await PersistentBitmaps::load(*file, *h, true);
  if (!bm) co_return bm.status().with_context(path);
  auto bits = (*bm)->bits_of(name);
  if (!bits) co_return bits.status();
  BitmapBits out;
  out.disk_size = bits->disk_size();
  out.granularity = uint64_t{1} << bits->granularity_bits();
  for (const qcow2::DirtyRange& r : bits->dirty_ranges()) out.dirty.emplace_back(r.offset, r.length);
  co_return out;
}

}  // namespace

const BitmapOps kQcow2BitmapOps{.run = run_bitmap_ops, .read = read_bitmap};

}  // namespace qcowfs::image
