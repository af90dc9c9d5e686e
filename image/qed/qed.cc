// open_qed(): header, backing file name, L1 table, then an ExtentDriver.
#include "image/qed/qed.h"

#include <algorithm>
#include <cstring>

#include "image/backing.h"
#include "image/endian.h"
#include "image/extent/driver.h"
#include "image/extent/host_read.h"
#include "image/qed/format.h"
#include "image/qed/header.h"
#include "image/qed/map.h"
#include "image/qed/writer.h"

namespace qcowfs::image {
namespace {

using qed::Header;

// The backing file name as QEMU's qed_read_string() leaves it: a C string,
// so it ends at the first NUL.
Task<Result<std::string>> read_backing_name(io::HostFile& file, const Header& h) {
  if (!h.has_backing()) co_return std::string();
  std::vector<std::byte> bytes(h.backing_filename_size);
  QCOWFS_CO_TRY(co_await read_padded(file, h.backing_filename_offset, bytes));
  std::string name(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  name.resize(std::min(name.size(), name.find('\0')));
  co_return name;
}

// The L1 entries that map image_size; for a read-write open the whole table
// (up to kMaxL1Bytes), so that the disk can grow without reading it again.
Task<Result<std::vector<uint64_t>>> read_l1(io::HostFile& file, const Header& h, const std::string& path,
                                            bool writable) {
  uint64_t entries = h.l1_entries();
  if (writable) entries = std::max(entries, std::min<uint64_t>(h.table_nelems, qed::kMaxL1Bytes / sizeof(uint64_t)));
  if (entries * sizeof(uint64_t) > qed::kMaxL1Bytes)
    co_return Status::errorf(EINVAL, "{}: the QED L1 table needs {} entries for image_size {}, more than qcowfs reads",
                             path, entries, h.image_size);
  std::vector<std::byte> bytes(static_cast<size_t>(entries * sizeof(uint64_t)));
  auto st = co_await read_padded(file, h.l1_table_offset, bytes);
  if (!st) co_return st.with_context(path + ": Failed to read L1 table");
  std::vector<uint64_t> l1(static_cast<size_t>(entries));
  for (size_t i = 0; i < l1.size(); ++i) l1[i] = load_le64(bytes.data() + i * sizeof(uint64_t));
  co_return l1;
}

ImageDetails describe(const Header& h, const std::string& backing_name) {
  ImageDetails d;
  d.cluster_size = h.cluster_size;
  d.backing_file = backing_name;
  if (!backing_name.empty() && h.backing_is_raw()) d.backing_format = "raw";
  // QEMU shows "dirty-flag": false even when need-check is set: a read-only
  // open arms the need-check timer, and the drain that ends bdrv_open() fires
  // it at once (bdrv_qed_co_drain_begin), clearing the bit in memory (its
  // header write fails on the read-only file). We match what info prints.
  d.dirty = false;
  return d;
}

// A need-check image opened read-write: QEMU runs its check and repairs what
// it finds (bdrv_qed_do_open). We check every L1 and L2 entry as QEMU's check
// does; an image with a bad one is refused read-write (qemu-img check -r all
// repairs it), one without has the bit cleared (leaked clusters are harmless).
Task<Status> check_tables(io::HostFile& file, const Header& h, const qed::QedMap& map, const std::string& path) {
  auto refuse = [&](std::string what) {
    return Status::errorf(EIO,
                          "{}: the QED image needs a check and {}; repair it with qemu-img check -r all or "
                          "mount it read-only",
                          path, what);
  };
  constexpr uint64_t kPiece = 1 << 20;
  std::vector<std::byte> piece(static_cast<size_t>(std::min<uint64_t>(h.table_bytes(), kPiece)));
  for (uint64_t i = 0; i < map.l1_entries(); ++i) {
    const uint64_t l2 = map.l1_entry(i);
    if (l2 == qed::kUnallocated) continue;
    if (!h.valid_table_offset(l2)) co_return refuse(fmt::format("L1 entry {} names an invalid table {:#x}", i, l2));
    for (uint64_t off = 0; off < h.table_bytes(); off += piece.size()) {
      QCOWFS_CO_TRY(co_await read_padded(file, l2 + off, piece));
      for (size_t at = 0; at < piece.size(); at += sizeof(uint64_t)) {
        const uint64_t e = load_le64(piece.data() + at);
        if (e != qed::kUnallocated && e != qed::kZeroCluster && !h.valid_cluster_offset(e))
          co_return refuse(fmt::format("the L2 table at {:#x} has an invalid entry {:#x}", l2, e));
      }
    }
  }
  co_return Status::ok();
}

Task<Result<std::unique_ptr<ExtentWriter>>> make_writer(io::HostFile& file, const std::string& path, const Header& h,
                                                        qed::QedMap& map) {
  if (h.need_check()) QCOWFS_CO_TRY(co_await check_tables(file, h, map, path));
  io::AlignedBuffer header(qed::kSectorSize, file.mem_align(), true);
  QCOWFS_CO_TRY(co_await read_padded(file, 0, header.span()));
  io::AlignedBuffer l1(static_cast<size_t>(qed::QedWriter::l1_bytes_size(map)), file.mem_align(), true);
  QCOWFS_CO_TRY(co_await read_padded(file, h.l1_table_offset, l1.span()));
  auto w = std::make_unique<qed::QedWriter>(file, path, h, map, std::move(header), std::move(l1));
  if (h.need_check()) {
    Status st = co_await w->clear_need_check();
    if (!st) co_return st.with_context(path + ": clearing the QED need-check bit");
  }
  co_return std::unique_ptr<ExtentWriter>(std::move(w));
}

}  // namespace

Task<Result<std::unique_ptr<BlockDriver>>> open_qed(std::unique_ptr<io::HostFile> file, std::string path,
                                                    ImageOptions opts) {
  if (auto chain = enter_backing_chain(path, opts); !chain) co_return chain.status();
  auto h = co_await qed::read_header(*file, path);
  if (!h) co_return h.status();
  auto backing_name = co_await read_backing_name(*file, *h);
  if (!backing_name) co_return backing_name.status();
  auto l1 = co_await read_l1(*file, *h, path, opts.file.writable);
  if (!l1) co_return l1.status();

  ExtentImage img;
  img.format = "qed";
  img.path = path;
  img.size = h->image_size;
  img.details = describe(*h, *backing_name);
  auto map = std::make_unique<qed::QedMap>(*file, path, *h, std::move(*l1), opts.table_cache_size);
  if (opts.file.writable) QCOWFS_CO_TRY(take_writer(img, co_await make_writer(*file, path, *h, *map)));
  img.map = std::move(map);
  img.files.push_back(std::move(file));
  if (!backing_name->empty() && !opts.no_backing) {
    auto b = co_await open_backing_file(path, *backing_name, img.details.backing_format, opts);
    if (!b) co_return b.status();
    img.backing = std::move(*b);
  }
  co_return std::unique_ptr<BlockDriver>(std::make_unique<ExtentDriver>(std::move(img)));
}

}  // namespace qcowfs::image
