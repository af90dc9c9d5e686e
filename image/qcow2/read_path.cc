#include "image/qcow2/read_path.h"

#include <algorithm>

#include "image/crypto/cipher.h"
#include "image/endian.h"
#include "io/align.h"
#include "io/log.h"

namespace qcowfs::image::qcow2 {
namespace {

// Whether extent e, following `first` (length bytes long so far) in one L2
// slice, reads the same way: same kind (never two compressed clusters) and,
// where they name host space, host offsets that continue each other.
bool extends(const Extent& first, uint64_t length, const Extent& e) {
  if (e.kind != first.kind || e.kind == ExtentKind::compressed) return false;
  if ((e.file == nullptr) != (first.file == nullptr)) return false;
  return first.file == nullptr || first.host_offset + length == e.host_offset;
}

}  // namespace

Status L2Map::corrupt(GuestOffset guest, const Status& why) const {
  log::error("{}{}: corrupt qcow2 metadata for guest offset {:#x}: {}", img_.path, snapshot_view_ ? " (snapshot)" : "",
             guest, why.message());
  return Status::errorf(EIO, "corrupt qcow2 metadata for guest offset {:#x}: {}", guest, why.message());
}

Result<L2Map::Place> L2Map::place(GuestOffset guest, uint64_t len) const {
  const Geometry& g = img_.geometry;
  const uint64_t l2_entries = g.l2_entries();
  const uint64_t l1_index = (guest >> g.cluster_bits) / l2_entries;
  uint64_t l2_table = 0;
  if (l1_index < l1_.entries.size()) {
    auto l2 = decode_l1_entry(g, l1_.load(static_cast<size_t>(l1_index)));
    if (!l2) return corrupt(guest, l2.status());
    l2_table = *l2;
  }
  if (l2_table == 0) {  // the whole range of this L1 entry is unallocated
    Extent e;
    e.kind = ExtentKind::unallocated;
    e.length = std::min(len, (l1_index + 1) * l2_entries * g.cluster_size() - guest);
    return Place{e, 0};
  }
  const uint64_t slice_entries = img_.l2_slice_entries();
  const uint64_t l2_index = (guest >> g.cluster_bits) % l2_entries;
  return Place{std::nullopt, l2_table + (l2_index / slice_entries) * img_.l2_cache->slice_size()};
}

// The extent of the run r at guest. Encrypted data has no host offset a
// reader could use (QEMU sets no BDRV_BLOCK_OFFSET_VALID for it either).
Extent L2Map::extent_of(const ClusterRun& r, GuestOffset guest) const {
  const bool shown = !img_.crypt_file && !img_.legacy_cipher;
  Extent e;
  e.kind = r.kind;
  e.length = r.length;
  switch (r.kind) {
    case ExtentKind::data:
      e.file = img_.data_io;
      e.host_offset = r.host_offset;
      e.show_offset = shown;
      break;
    case ExtentKind::zero:
    case ExtentKind::unallocated:
      if (r.mapped && shown) {  // ZERO_ALLOC, UNALLOCATED_ALLOC
        e.file = img_.data_file;
        e.host_offset = r.host_offset;
      }
      break;
    case ExtentKind::compressed: {
      const uint64_t cs = img_.geometry.cluster_size();
      e.file = img_.file.get();
      e.host_offset = r.compressed.host_offset;
      e.unit_offset = guest & (cs - 1);
      e.unit_size = cs;
      e.stored_size = r.compressed.size;
      e.show_offset = false;
      break;
    }
  }
  return e;
}

// The entries of one L2 slice from guest's on, merged while they extend the
// first. A corrupt entry past the first ends the extent (the next lookup
// reports it with its own guest offset).
Result<Extent> L2Map::in_slice(std::span<const std::byte> entries, GuestOffset guest, uint64_t len) const {
  const Geometry& g = img_.geometry;
  const uint64_t cs = g.cluster_size();
  const size_t esz = g.l2_entry_size();
  const GuestOffset end = guest + len;
  Extent first;
  uint64_t length = 0;
  GuestOffset at = guest;
  for (size_t e = 0; e + esz <= entries.size() && at < end; e += esz) {
    const uint64_t entry = load_be64(entries.data() + e);
    const uint64_t bitmap = g.extended_l2 ? load_be64(entries.data() + e + kExtendedL2BitmapOffset) : 0;
    uint64_t in_cluster = at & (cs - 1);
    const uint64_t stop_at = in_cluster + std::min(end - at, cs - in_cluster);
    while (in_cluster < stop_at) {
      auto run = decode_cluster_run(g, entry, bitmap, in_cluster, stop_at - in_cluster);
      if (!run && length == 0) return corrupt(at, run.status());
      Extent x = run ? extent_of(*run, at) : Extent{};
      if (length == 0) {
        first = x;
      } else if (!run || !extends(first, length, x)) {
        first.length = length;
        return first;
      }
      length += run->length;
      at += run->length;
      in_cluster += run->length;
    }
  }
  first.length = length;
  return first;
}

// Where guest's entry sits in its slice (bytes), and how many bytes of entries
// from there cover [guest, guest + len) inside the slice.
L2Map::Entries L2Map::entries_for(GuestOffset guest, uint64_t len) const {
  const Geometry& g = img_.geometry;
  const size_t esz = g.l2_entry_size();
  const uint64_t slice_entries = img_.l2_slice_entries();
  const uint64_t index = ((guest >> g.cluster_bits) % g.l2_entries()) % slice_entries;
  const uint64_t in_cluster = guest & (g.cluster_size() - 1);
  const uint64_t clusters = (in_cluster + len + g.cluster_size() - 1) >> g.cluster_bits;
  const uint64_t count = std::min(slice_entries - index, clusters);
  return Entries{static_cast<size_t>(index * esz), static_cast<size_t>(count * esz)};
}

// A request's few entries are copied out of the cached slice under one cache
// mutex round, without pinning it (no Ref, no shared_ptr count): the bytes
// cannot change meanwhile, since reads of a writable image hold their
// clusters' range lock and every mapping change holds it exclusive (as for
// the writer's overwrites, Qcow2Writer::read_cached_entry). Longer runs of
// entries are read through a pinned Ref.
Result<std::optional<Extent>> L2Map::try_map(uint64_t guest, uint64_t len) {
  auto p = place(guest, len);
  if (!p) return p.status();
  if (p->extent) return p->extent;
  const Entries want = entries_for(guest, len);
  if (want.bytes <= kCopiedEntryBytes) {
    std::byte copy[kCopiedEntryBytes];
    if (!img_.l2_cache->try_read(p->slice, want.at, std::span(copy, want.bytes))) return std::optional<Extent>();
    auto e = in_slice(std::span<const std::byte>(copy, want.bytes), guest, len);
    if (!e) return e.status();
    return std::optional<Extent>(*e);
  }
  auto ref = img_.l2_cache->try_get(p->slice);
  if (!ref) return std::optional<Extent>();
  auto e = in_slice(ref->bytes().subspan(want.at), guest, len);
  if (!e) return e.status();
  return std::optional<Extent>(*e);
}

Task<Result<Extent>> L2Map::map(uint64_t guest, uint64_t len) {
  auto p = place(guest, len);
  if (!p) co_return p.status();
  if (p->extent) co_return *p->extent;
  auto ref = co_await img_.l2_cache->get(p->slice);
  if (!ref) co_return ref.status().with_context(fmt::format("guest offset {:#x}", guest));
  co_return in_slice(ref->bytes().subspan(entries_for(guest, len).at), guest, len);
}

Status L2Map::decompress(const Extent&, std::span<const std::byte> stream, std::span<std::byte> out) const {
  return decompress_cluster(img_.header.compression_type, stream, out);
}

Task<Status> LegacyDecrypt::after_read(uint64_t guest, std::span<std::byte> dst) const {
  return crypto::decrypt_async(*img_.legacy_cipher, guest, dst);
}

ReadPath::ReadPath(Qcow2Image& image, const L1Table& l1, bool snapshot_view)
    : img_(image),
      map_(image, l1, snapshot_view),
      decrypt_(image),
      reader_(image.path, map_, image.backing, *image.cluster_cache, image.legacy_cipher ? &decrypt_ : nullptr) {}

Task<Status> ReadPath::read(GuestOffset guest, std::span<std::byte> buf) {
  if (!lock_reads_ || buf.empty()) return reader_.read(guest, buf);
  return read_locked(guest, buf);
}

std::optional<MappedRead> ReadPath::map_read(GuestOffset guest, uint64_t len) {
  if (!lock_reads_) return reader_.map_read(guest, len);
  const uint64_t cs = img_.geometry.cluster_size();
  io::RangeLock::Guard range =
      ranges_.try_lock(align_down(guest, cs), align_up(guest + len, cs), io::RangeLock::Mode::shared);
  // Not owned: a writer changes a mapping here, and read() waits for it.
  std::optional<MappedRead> run = range.owns() ? reader_.map_read(guest, len) : std::nullopt;
  if (run) run->keep(std::move(range).into_hold());
  return run;
}

Task<Status> ReadPath::read_locked(GuestOffset guest, std::span<std::byte> buf) {
  const uint64_t cs = img_.geometry.cluster_size();
  auto range = co_await ranges_.lock(align_down(guest, cs), align_up(guest + buf.size(), cs),
                                     io::RangeLock::Mode::shared);
  co_return co_await reader_.read(guest, buf);
}

}  // namespace qcowfs::image::qcow2
