// ReadPath: the read mapping of one qcow2 view (the active image or one
// snapshot): walks a guest range's L1/L2 entries into runs (image/qcow2/l2.h)
// and reads them. Qcow2Driver reads and answers block_status through it;
// Qcow2Writer reads the old contents of partly written clusters (copy-on-write)
// through read_unlocked(). Neither calls the other: the writer depends on the
// read path, never the reverse.
//
// Reads: guest-contiguous runs with contiguous host offsets become one host
// read, unallocated runs one backing read (zeros past the backing file's end),
// zero runs are filled in place, compressed clusters are decompressed once
// (ClusterCache); all reads of one request are issued together (io::when_all)
// straight into the caller's buffer.
//
// The guest range lock lives here because it is what reads and writes share:
// on a writable image (lock_reads()) read() holds the request's clusters
// shared, and every writer request that changes a mapping holds them
// exclusive, so a read never sees a cluster while its mapping changes.
//
// Thread-safety: all methods may be called concurrently from any event-loop
// thread. lock_reads() is called once at open, before any request. The L1
// table is read through L1Table::load (the writer may store an entry
// meanwhile); the image and the L1 table must outlive the ReadPath.
#pragma once

#include <cstdint>
#include <span>
#include <type_traits>

#include "image/qcow2/image_state.h"
#include "io/range_lock.h"

namespace qcowfs::image::qcow2 {

class ReadPath {
 public:
  // Non-owning reference to a run visitor (no allocation per request). The
  // callable must outlive the walk: pass a lambda in the co_await expression.
  class RunVisitor {
   public:
    template <typename F>
    RunVisitor(F&& f)  // NOLINT: implicit by design
        : obj_(static_cast<void*>(&f)),
          call_([](void* o, GuestOffset guest, const ClusterRun& run) {
            return (*static_cast<std::remove_reference_t<F>*>(o))(guest, run);
          }) {}
    bool operator()(GuestOffset guest, const ClusterRun& run) const { return call_(obj_, guest, run); }

   private:
    void* obj_;
    bool (*call_)(void*, GuestOffset, const ClusterRun&);
  };

  ReadPath(Qcow2Image& image, const L1Table& l1, bool snapshot_view)
      : img_(image), l1_(l1), snapshot_view_(snapshot_view) {}

  // From now on read() takes the guest range lock (a writable image).
  void lock_reads() { lock_reads_ = true; }
  // Guest byte ranges, cluster aligned.
  io::RangeLock& ranges() { return ranges_; }

  Task<Status> read(GuestOffset guest, std::span<std::byte> buf);
  // read() without the range lock: the caller holds it (copy-on-write source).
  Task<Status> read_unlocked(GuestOffset guest, std::span<std::byte> buf);
  // Walks the mapping of [guest, guest + len) in order, calling visit for each
  // run until it returns false. Corrupt metadata: EIO, logged with the offset.
  Task<Status> walk(GuestOffset guest, uint64_t len, RunVisitor visit);

 private:
  struct SubRead;
  struct Walk;

  Task<Status> walk_slice(Walk& w, HostOffset l2_table, RunVisitor& visit, bool* stop);
  Result<HostOffset> l2_table_for(uint64_t l1_index, GuestOffset guest) const;
  Status corrupt(GuestOffset guest, const Status& why) const;
  Task<Status> plan_reads(GuestOffset guest, std::span<std::byte> buf, std::vector<SubRead>& plan);
  Task<Status> run_sub_read(SubRead r);
  Task<Status> read_data(const SubRead& r);
  Task<Status> read_host(io::HostFile& f, HostOffset host, std::span<std::byte> dst);
  Task<Status> read_backing(GuestOffset guest, std::span<std::byte> dst);
  Task<Status> read_compressed(CompressedCluster c, uint64_t in_cluster, std::span<std::byte> dst);
  Task<Result<ClusterCache::Cluster>> load_compressed(CompressedCluster c);
  Task<Result<ClusterCache::Cluster>> decompress(CompressedCluster c, const io::AlignedBuffer& in);

  Qcow2Image& img_;
  const L1Table& l1_;
  const bool snapshot_view_;
  bool lock_reads_ = false;
  io::RangeLock ranges_;
};

}  // namespace qcowfs::image::qcow2
