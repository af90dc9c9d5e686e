// ExtentKind, Extent and ExtentMap: how a table-mapped image maps its guest
// bytes, one run ("extent") at a time. Every format's mapping speaks these
// words: the six formats of ExtentDriver (image/extent/driver.h) and qcow2
// (image/qcow2/map.h), and ExtentReader (image/extent/reader.h) reads through
// them.
//
// Thread-safety: ExtentMap::try_map() is called concurrently from every
// event-loop thread and must be thread-safe and never suspend; map() may
// suspend (it loads metadata through a TableCache); decompress() runs on a
// worker thread and must be pure.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>

#include "io/host_file.h"
#include "io/status.h"
#include "io/task.h"

namespace qcowfs::image {

enum class ExtentKind : uint8_t {
  data,         // stored uncompressed at host_offset in file
  zero,         // this image records the range as zeros (qemu's present zero)
  unallocated,  // this image records nothing: the backing image's bytes, else zeros
  compressed,   // inside a compressed unit (ExtentMap::decompress)
};

struct Extent {
  ExtentKind kind = ExtentKind::unallocated;
  uint64_t length = 0;           // bytes from the queried guest offset with this mapping (> 0)
  // data, compressed: the host file holding the bytes. zero, unallocated: the
  // file of host space the image names for them all the same (qcow2's
  // ZERO_ALLOC and UNALLOCATED_ALLOC, whose offset qemu-img map shows), else
  // nullptr.
  io::HostFile* file = nullptr;
  uint64_t host_offset = 0;      // data (zero, unallocated: with file): where the queried byte is;
                                 // compressed: the unit's key
  uint64_t unit_offset = 0;      // compressed: the queried byte's offset in the decompressed unit
  uint64_t unit_size = 0;        // compressed: the unit's decompressed size
  uint64_t stored_size = 0;      // compressed: bytes of the compressed stream at host_offset
  // data (zero, unallocated: with file): qemu-img map shows the host offset
  // ("offset") for these bytes.
  bool show_offset = true;
  // data (with show_offset): block_status() asks the host file too
  // (image/extent/host_holes.h), as QEMU does where a driver returns
  // BDRV_BLOCK_RECURSE (VMDK flat extents, static VDI): its holes, and bytes
  // past its end, are reported as data that reads as zeros.
  bool host_holes_are_zero = false;
};

class ExtentMap {
 public:
  virtual ~ExtentMap() = default;
  ExtentMap() = default;
  ExtentMap(const ExtentMap&) = delete;
  ExtentMap& operator=(const ExtentMap&) = delete;

  // The extent that starts at guest byte `guest`, at most len bytes long
  // (guest < size, len > 0), from metadata already in memory; std::nullopt
  // when that metadata is not in memory (the driver then calls map()).
  // Corrupt metadata: EIO, with the guest offset in the message.
  virtual Result<std::optional<Extent>> try_map(uint64_t guest, uint64_t len) = 0;
  // The same, loading the metadata it needs. Default: try_map(), where
  // std::nullopt is an internal error (EIO).
  virtual Task<Result<Extent>> map(uint64_t guest, uint64_t len);
  // The decompressed unit of a compressed extent (unit_size bytes), given the
  // compressed stream read from e.file at e.host_offset (e.stored_size bytes,
  // zero-padded past the end of the file). Called on a worker thread; pure.
  // Default: EIO (the format has no compressed extents).
  virtual Status decompress(const Extent& e, std::span<const std::byte> stream, std::span<std::byte> out) const;
};

}  // namespace qcowfs::image
