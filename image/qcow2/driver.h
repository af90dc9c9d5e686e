// Qcow2Driver: a BlockDriver over one qcow2 image, or over one of its internal
// snapshots. The image-wide state (header, files, backing driver, caches,
// snapshot table) lives in a shared Qcow2Image; each driver is a view of it
// with its own L1 table and guest size, so snapshot views share the host file,
// data file, backing file and L2 cache with the active image.
//
// Reads: a request is mapped into runs (image/qcow2/l2.h); guest-contiguous
// runs with contiguous host offsets in the same file become one host read,
// unallocated runs one backing read, zero runs are filled in place, and all
// the reads of one request are issued together (io::when_all). Data goes
// straight into the caller's buffer.
//
// Writes: a driver opened writable (the active image only, never a snapshot
// view) owns a Qcow2Writer (image/qcow2/writer.h) and forwards write, flush,
// discard, write_zeroes, truncate, idle_writeback and close to it. Reads of a
// writable image take the writer's guest range lock shared, so they never see
// a cluster while its mapping changes.
//
// Thread-safety: as BlockDriver. On a read-only image the header, L1 tables
// and snapshot table are immutable after open; on a writable one the active
// L1 table and the header change only in the writer, under its metadata lock.
// The caches are internally synchronised.
#pragma once

#include <atomic>
#include <memory>
#include <type_traits>
#include <string>
#include <vector>

#include "image/block_driver.h"
#include "image/qcow2/compress.h"
#include "image/qcow2/header.h"
#include "image/qcow2/l2.h"
#include "image/qcow2/l2_cache.h"
#include "image/qcow2/layout.h"
#include "image/qcow2/snapshot.h"

namespace qcowfs::image::qcow2 {

// An L1 table in memory (host byte order) and where it lives in the file.
// The writer changes an entry (under its metadata lock) while reads and pure
// overwrites of other clusters under the same entry read it without that lock:
// such accesses go through load() and store() (atomic, acquire/release). The
// vector itself and host_offset change only with the whole guest range locked
// exclusive (Qcow2Writer::grow_l1), which every reader's range lock excludes.
struct L1Table {
  uint64_t host_offset = 0;
  std::vector<uint64_t> entries;

  uint64_t load(size_t i) const {
    return std::atomic_ref<uint64_t>(const_cast<uint64_t&>(entries[i])).load(std::memory_order_acquire);
  }
  void store(size_t i, uint64_t e) { std::atomic_ref<uint64_t>(entries[i]).store(e, std::memory_order_release); }
};

// State shared by every view of one image.
struct Qcow2Image {
  Header header;
  Geometry geometry;
  std::string path;
  std::unique_ptr<io::HostFile> file;
  std::unique_ptr<io::HostFile> data_file_owned;  // external data file, if any
  io::HostFile* data_file = nullptr;               // where data clusters live
  std::unique_ptr<BlockDriver> backing;
  std::vector<Snapshot> snapshots;
  std::unique_ptr<L2Cache> l2_cache;
  std::unique_ptr<ClusterCache> cluster_cache;
  // Writable images: metadata at open, and whether corruption was found since
  // (then writes fail with EIO; image/qcow2/layout.h).
  MetadataLayout layout;
  std::atomic<bool> corrupt{false};
  // Whether QEMU would take the image for one made with preallocation=metadata
  // (image/qcow2/status.h); settled by the first block_status() call.
  enum class PreallocGuess : uint8_t { unknown, no, yes };
  std::atomic<PreallocGuess> metadata_prealloc{PreallocGuess::unknown};

  size_t l2_slice_entries() const { return l2_cache->slice_size() / geometry.l2_entry_size(); }
};

class Qcow2Writer;

class Qcow2Driver final : public BlockDriver {
 public:
  Qcow2Driver(std::shared_ptr<Qcow2Image> image, L1Table l1, uint64_t size, bool snapshot_view);
  ~Qcow2Driver() override;

  // Makes this (active image) driver writable: loads the refcounts, rebuilding
  // them first when the image is dirty.
  Task<Status> enable_writes(const ImageOptions& opts);

  std::string_view format_name() const override { return "qcow2"; }
  uint64_t size() const override;
  bool read_only() const override { return writer_ == nullptr; }
  size_t mem_align() const override { return image_->data_file->mem_align(); }

  Task<Status> read(uint64_t off, std::span<std::byte> buf) override;
  Task<Status> write(uint64_t off, std::span<const std::byte> buf) override;
  Task<Status> flush() override;
  Task<Status> discard(uint64_t off, uint64_t len) override;
  Task<Status> write_zeroes(uint64_t off, uint64_t len, bool may_unmap) override;
  Task<Status> truncate(uint64_t new_size) override;
  Task<Result<BlockStatus>> block_status(uint64_t off, uint64_t len) override;
  uint64_t allocated_bytes() const override;
  Task<Status> close() override;
  Task<Status> idle_writeback() override;

  std::vector<SnapshotInfo> snapshots() const override;
  Task<Result<std::unique_ptr<BlockDriver>>> open_snapshot(std::string id_or_name) override;

  const Qcow2Image& image() const { return *image_; }
  const L1Table& l1_table() const { return l1_; }
  Qcow2Writer* writer() { return writer_.get(); }

 private:
  struct SubRead;
  struct Plan;
  // Non-owning reference to a run visitor (no allocation per request). The
  // callable must outlive the walk: pass a lambda in the co_await expression.
  class RunVisitor {
   public:
    template <typename F>
    RunVisitor(F&& f)  // NOLINT: implicit by design
        : obj_(static_cast<void*>(&f)),
          call_([](void* o, uint64_t guest, const ClusterRun& run) {
            return (*static_cast<std::remove_reference_t<F>*>(o))(guest, run);
          }) {}
    bool operator()(uint64_t guest, const ClusterRun& run) const { return call_(obj_, guest, run); }

   private:
    void* obj_;
    bool (*call_)(void*, uint64_t, const ClusterRun&);
  };

  // Walks the mapping of [off, off+len) in order, calling visit for each run
  // until it returns false. Corrupt metadata: EIO, logged with the offset.
  Task<Status> walk(uint64_t off, uint64_t len, RunVisitor visit);
  // read() without the writer's range lock (the copy-on-write source).
  Task<Status> read_unlocked(uint64_t off, std::span<std::byte> buf);
  Result<uint64_t> l2_table_for(uint64_t l1_index, uint64_t guest);
  Status corrupt(uint64_t guest, const Status& why) const;
  Status refuse_corrupt() const;  // EIO for writes after corruption was found
  Task<Status> run_sub_read(SubRead r);
  Task<Status> read_host(io::HostFile& f, uint64_t host, std::span<std::byte> dst);
  Task<Status> read_backing(uint64_t guest, std::span<std::byte> dst);
  Task<Status> read_compressed(CompressedCluster c, uint64_t in_cluster, std::span<std::byte> dst);
  Task<Result<ClusterCache::Cluster>> load_compressed(CompressedCluster c);
  Task<Result<BlockStatus>> backing_status(uint64_t off, uint64_t len);

  std::shared_ptr<Qcow2Image> image_;
  L1Table l1_;
  uint64_t size_;
  bool snapshot_view_;
  std::unique_ptr<Qcow2Writer> writer_;
};

}  // namespace qcowfs::image::qcow2
