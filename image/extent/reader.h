// ExtentReader: the read engine of every table-mapped image (ExtentDriver's
// six formats and qcow2). It reads guest bytes through an ExtentMap
// (image/extent/map.h):
//
//   - guest-contiguous extents that are contiguous in one host file become
//     one host read, straight into the caller's buffer; every host read of a
//     request is issued together (io::when_all);
//   - unallocated extents are read from the backing image (zeros past its
//     end, or with no backing image), in one read per guest-contiguous run;
//   - zero extents are filled in place;
//   - compressed extents are decompressed once per unit (ExtentMap::decompress,
//     on a worker thread) and kept in a ClusterCache;
//   - an optional ReadFilter sees the bytes of each data read (qcow2's legacy
//     AES decrypts them by guest offset).
//
// Extents come from ExtentMap::try_map() without suspending while the map's
// metadata is in memory; map() (which may load it) is awaited only on a miss.
// A host read past the end of its file reads as zeros (as QEMU's file driver
// does). block_status() merges extents as `qemu-img map` prints them and asks
// the backing image for unallocated ranges.
//
// What stays the caller's: locks and lock-free I/O tracking around a read
// (ExtentDriver's InFlightIo, qcow2's guest range lock), and writes.
//
// Thread-safety: read(), extent_at() and block_status() may be called
// concurrently from any event-loop thread. The map, the backing driver (held
// by reference to its owner's pointer, which must not change while requests
// run), the cache and the filter must outlive the reader.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "image/block_driver.h"
#include "image/extent/cluster_cache.h"
#include "image/extent/map.h"
#include "io/inline_vector.h"

namespace qcowfs::image {

// Applied to the bytes of every data extent once they are read: guest is the
// guest offset of dst's first byte.
class ReadFilter {
 public:
  virtual ~ReadFilter() = default;
  virtual Task<Status> after_read(uint64_t guest, std::span<std::byte> dst) const = 0;
};

class ExtentReader {
 public:
  // path: for messages. units: the decompressed compressed units.
  ExtentReader(const std::string& path, ExtentMap& map, const std::unique_ptr<BlockDriver>& backing,
               ClusterCache& units, const ReadFilter* filter = nullptr)
      : path_(path), map_(map), backing_(backing), units_(units), filter_(filter) {}
  ExtentReader(const ExtentReader&) = delete;
  ExtentReader& operator=(const ExtentReader&) = delete;

  // Guest bytes [off, off + buf.size()), inside the image.
  Task<Status> read(uint64_t off, std::span<std::byte> buf);
  // read()'s one-host-read case, never suspending (BlockDriver::map_read):
  // [off, off + len) maps, from what try_map() finds in memory, to data
  // extents of one file that continue each other, and there is no filter.
  // No holds: the caller adds what keeps the mapping valid.
  std::optional<MappedRead> map_read(uint64_t off, uint64_t len);
  // The map's extent at guest, checked: between 1 and len bytes long.
  Task<Result<Extent>> extent_at(uint64_t guest, uint64_t len);
  // The status of [off, off + len) from off on (len > 0, inside the image), as
  // qemu-img map shows it: the extents of one kind merged (data and
  // zero/unallocated extents with a shown host offset only where those
  // continue each other), unallocated ranges as the backing image reports them.
  Task<Result<BlockStatus>> block_status(uint64_t off, uint64_t len);

 private:
  struct SubRead;
  // A request's sub-reads: almost always one, kept inline (no malloc per read).
  using SubReads = InlineVector<SubRead, 4>;

  Status check(const Extent& e, uint64_t guest, uint64_t len) const;
  Task<Result<Extent>> load(uint64_t guest, uint64_t len);
  void add(const Extent& e, uint64_t guest, std::span<std::byte> dst, SubReads& out) const;
  Task<Status> run(SubRead r);
  Task<Status> read_data(const SubRead& r);
  Task<Status> read_compressed(const Extent& e, std::span<std::byte> dst);
  Task<Result<ClusterCache::Cluster>> load_unit(const Extent& e);
  Task<Result<BlockStatus>> backing_status(uint64_t guest, uint64_t len);

  const std::string& path_;
  ExtentMap& map_;
  const std::unique_ptr<BlockDriver>& backing_;
  ClusterCache& units_;
  const ReadFilter* const filter_;
};

}  // namespace qcowfs::image
