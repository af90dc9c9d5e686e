// The state one open qcow2 image shares between its views (Qcow2Image) and
// the in-memory L1 table of one view (L1Table). Qcow2Driver (image/qcow2/driver.h)
// is a view; ReadPath (read_path.h) and Qcow2Writer (writer.h) work on these.
//
// Thread-safety: on a read-only image everything here is immutable after open
// except the internally synchronised caches. On a writable one the header and
// the active L1 table change only in the writer, under its metadata lock (L1
// entries are read without it through L1Table::load); `corruption` is
// internally synchronised (image/qcow2/corruption.h).
#pragma once

#include <atomic>
#include <bit>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "image/block_driver.h"
#include "image/extent/cluster_cache.h"
#include "image/crypto/file.h"
#include "image/crypto/unlock.h"
#include "image/qcow2/compress.h"
#include "image/qcow2/corruption.h"
#include "image/qcow2/header.h"
#include "image/qcow2/l2.h"
#include "image/qcow2/layout.h"
#include "image/qcow2/snapshot.h"
#include "image/extent/table_cache.h"

namespace qcowfs::image::qcow2 {

// An L1 table in memory (host byte order) and where it lives in the file.
// The writer changes an entry (under its metadata lock) while reads and pure
// overwrites of other clusters under the same entry read it without that lock:
// such accesses go through load() and store() (atomic, acquire/release). The
// vector itself and host_offset change only with the whole guest range locked
// exclusive (Qcow2Writer::grow_l1), which every reader's range lock excludes.
struct L1Table {
  // An L1 entry on disk: one big-endian 64-bit word.
  static constexpr uint64_t kEntryBytes = sizeof(uint64_t);

  HostOffset host_offset = 0;
  std::vector<uint64_t> entries;

  uint64_t load(size_t i) const {
    return std::atomic_ref<uint64_t>(const_cast<uint64_t&>(entries[i])).load(std::memory_order_acquire);
  }
  void store(size_t i, uint64_t e) { std::atomic_ref<uint64_t>(entries[i]).store(e, std::memory_order_release); }
  uint64_t bytes() const { return entries.size() * kEntryBytes; }
};

// State shared by every view of one image.
struct Qcow2Image {
  Header header;
  Geometry geometry;
  std::string path;
  std::unique_ptr<io::HostFile> file;
  std::unique_ptr<io::HostFile> data_file_owned;  // external data file, if any
  io::HostFile* data_file = nullptr;               // where data clusters live
  // Where guest data is read and written: data_file, or on a LUKS-encrypted
  // image the CryptFile over it (IVs from the host offset).
  io::HostFile* data_io = nullptr;
  std::unique_ptr<crypto::CryptFile> crypt_file;
  std::optional<crypto::UnlockedLuks> luks;  // crypt_method 2: the header (for info)
  // crypt_method 1 (legacy AES, read-only): decrypts data runs by guest offset.
  std::shared_ptr<const crypto::SectorCipher> legacy_cipher;
  std::unique_ptr<BlockDriver> backing;
  std::vector<Snapshot> snapshots;
  std::unique_ptr<TableCache> l2_cache;
  std::unique_ptr<ClusterCache> cluster_cache;
  // Writable images: metadata at open (image/qcow2/layout.h), and whether
  // corruption was found since (then writes fail with EIO).
  MetadataLayout layout;
  Corruption corruption;
  // Whether QEMU would take the image for one made with preallocation=metadata
  // (image/qcow2/metadata_prealloc.h); settled by the first block_status() call.
  enum class PreallocGuess : uint8_t { unknown, no, yes };
  std::atomic<PreallocGuess> metadata_prealloc{PreallocGuess::unknown};

  // L2 entries per cached slice: a power of two (the slice size is one, at
  // least a standard entry: setup_caches()), computed as a shift.
  size_t l2_slice_entries() const {
    const auto slice_bits = static_cast<uint32_t>(std::countr_zero(l2_cache->slice_size()));
    return size_t{1} << (slice_bits - geometry.l2_entry_bits());
  }
  // Marks the image corrupt (image/qcow2/corruption.h) and returns the EIO
  // Status for the request that found `what`.
  Task<Status> signal_corruption(std::string what) {
    return corruption.signal(*file, header, path, std::move(what));
  }
};

}  // namespace qcowfs::image::qcow2
