// Qcow2Writer: compressed writes (compress=on). Which clusters of a request
// are stored compressed, their compression on the worker pool, their placement
// (ClusterAllocator::allocate_bytes, QEMU's byte packing) and their host
// writes; write_allocating (writer_data.cc) drives these steps and commit()
// (writer_commit.cc) sets their entries. Rules: image/qcow2/DESIGN.md
// "Compressed writes".
#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>

#include "image/qcow2/compress.h"
#include "image/qcow2/writer_plan.h"
#include "io/align.h"
#include "io/engine.h"
#include "io/log.h"
#include "io/when_all.h"

namespace qcowfs::image::qcow2 {

Status Qcow2Writer::check_compress_allowed(const Qcow2Image& image) {
  // QEMU's qcow2_co_pwritev_compressed_part answers ENOTSUP here.
  if (image.header.has_external_data_file())
    return Status::error(EINVAL, "compress=on: an image with an external data file cannot hold compressed "
                                 "clusters (QEMU cannot write them either)");
  // QEMU would write the compressed stream as it is, unencrypted, into an
  // encrypted image: refused rather than leaking plaintext.
  if (image.header.crypt_method != kCryptNone)
    return Status::error(EINVAL, "compress=on: refused on an encrypted image (compressed clusters are stored "
                                 "unencrypted in qcow2, so compressing would write plaintext)");
  return Status::ok();
}

// The request covers the whole cluster: all of it, or (the disk's last,
// partial cluster) all of it up to the disk's end, the rest read as zeros.
bool Qcow2Writer::whole_cluster_write(const Slot& s) const {
  const Geometry& g = img_.geometry;
  return s.rq_start == 0 && (s.rq_end == g.cluster_size() || (s.gc << g.cluster_bits) + s.rq_end == size());
}

// An allocate slot written whole whose entry names no host cluster
// (unallocated or zero) needs no copy-on-write and frees nothing: QEMU's
// qcow2_alloc_compressed_cluster_offset takes only such clusters. Anything
// else (partial writes, allocated, compressed or shared clusters) is written
// as without compression.
bool Qcow2Writer::mark_compressible(Plan& plan) const {
  if (!compress_) return false;
  const Geometry& g = img_.geometry;
  bool any = false;
  for (Slot& s : plan.slots) {
    if (s.kind != Kind::allocate || !whole_cluster_write(s)) continue;
    const L2EntryClass c = decode_l2_entry(g, s.old_entry, s.old_bitmap);
    if (c.kind == L2Kind::compressed || c.allocated || c.host != 0) continue;
    s.kind = Kind::compressed;
    any = true;
  }
  return any;
}

// The exclusive range lock keeps the slots' entries as mapped; the metadata
// lock is free while the clusters compress.
Task<Status> Qcow2Writer::compress_and_allocate(Plan& plan, GuestOffset guest, std::span<const std::byte> buf) {
  QCOWFS_CO_TRY(co_await compress_slots(plan, guest, buf));
  auto m = co_await meta_.lock();
  // Both steps skip what an earlier try (before an EAGAIN) already did.
  auto allocate = [&]() -> Task<Status> {
    QCOWFS_CO_TRY(co_await allocate_run(plan));
    co_return co_await place_compressed(plan);
  };
  Status st = co_await with_refcount_room(m, allocate);
  if (st) co_return st;
  auto relock = co_await meta_.lock();
  Status u = co_await undo(plan);
  if (!u) log::error("{}: releasing clusters of a failed write: {}", img_.path, u.message());
  co_return st;
}

namespace {

// One cluster of a request to compress, filled in by a worker.
struct CompressItem {
  uint64_t guest = 0;                // the cluster's guest offset (for messages)
  std::span<const std::byte> in;     // its bytes in the request (short: the disk's last cluster)
  io::AlignedBuffer* packed = nullptr;
  uint64_t* csize = nullptr;
  Status status;
};

// Compresses one item on the calling (worker) thread.
Status compress_item(uint8_t type, size_t cluster_size, CompressItem& item) {
  std::span<const std::byte> in = item.in;
  io::AlignedBuffer padded;
  if (in.size() < cluster_size) {  // the disk's last cluster: zeros past its end, as QEMU pads it
    padded = io::AlignedBuffer(cluster_size, io::kMinMemAlign, true);
    std::memcpy(padded.data(), in.data(), in.size());
    in = padded.span();
  }
  // One byte short of a cluster, as QEMU offers: a stream must save something.
  io::AlignedBuffer out(cluster_size - 1, io::kMinMemAlign, false);
  auto n = compress_cluster(type, in, out.span());
  if (!n) return n.status().with_context(fmt::format("compressing guest offset {:#x}", item.guest));
  *item.csize = *n;
  if (*n != 0) *item.packed = std::move(out);
  return Status::ok();
}

// One worker-pool job taking items from `next` until none is left: a
// request's clusters go to a few jobs (compress_job_count) rather than one
// job each, which spares a thread wake-up and an engine completion per
// cluster (bench/RESULTS.md "Compressed writes", loaded-machine profile).
Task<Status> compress_items(uint8_t type, size_t cluster_size, std::span<CompressItem> items,
                            std::atomic<size_t>& next) {
  const int64_t r = co_await io::offload([&]() -> int64_t {
    for (size_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items.size();)
      items[i].status = compress_item(type, cluster_size, items[i]);
    return 0;
  });
  if (r < 0) co_return Status::from_errno(static_cast<int>(-r), "compressing clusters");
  co_return Status::ok();
}

// Two jobs per CPU: on an idle machine one per CPU would do, but where other
// processes compete for the CPUs (builds beside a fill), a request whose
// clusters wait on two runnable threads gets half the CPU share it had with
// one job per cluster (bench/RESULTS.md, loaded-machine subsection).
size_t compress_job_count() {
  static const size_t n = 2 * std::max(1U, std::thread::hardware_concurrency());
  return n;
}

}  // namespace

// The marked clusters on a few worker-pool jobs, all at once. A cluster
// that does not shrink becomes an ordinary allocation.
Task<Status> Qcow2Writer::compress_slots(Plan& plan, GuestOffset guest, std::span<const std::byte> buf) {
  const uint64_t cs = img_.geometry.cluster_size();
  std::vector<CompressItem> items;
  for (Slot& s : plan.slots) {
    if (s.kind != Kind::compressed) continue;
    const uint64_t at = (s.gc * cs) - guest;  // rq_start is 0
    s.csize = 0;
    items.push_back(CompressItem{s.gc * cs, buf.subspan(static_cast<size_t>(at), static_cast<size_t>(s.rq_end)),
                                 &s.packed, &s.csize, Status::ok()});
  }
  std::atomic<size_t> next{0};
  std::vector<Task<Status>> jobs;
  const size_t n = std::min(items.size(), compress_job_count());
  for (size_t j = 0; j < n; ++j)
    jobs.push_back(compress_items(img_.header.compression_type, static_cast<size_t>(cs), items, next));
  QCOWFS_CO_TRY(co_await io::when_all(std::move(jobs)));
  for (CompressItem& item : items) QCOWFS_CO_TRY(std::move(item.status));
  for (Slot& s : plan.slots) {
    if (s.kind != Kind::compressed || s.csize != 0) continue;
    s.kind = Kind::allocate;  // classify_allocate already set it to write the whole cluster
    s.packed = io::AlignedBuffer();
  }
  co_return Status::ok();
}

// The streams in guest order, each right after the previous one where the
// allocator allows (allocate_bytes), so a request's streams are mostly one
// host-contiguous run.
Task<Status> Qcow2Writer::place_compressed(Plan& plan) {
  const uint32_t bits = img_.geometry.cluster_bits;
  for (Slot& s : plan.slots) {
    if (s.kind != Kind::compressed || s.placed) continue;
    auto run = co_await alloc_->allocate_bytes(s.csize);
    if (!run) co_return run.status();
    s.host = run->offset;
    s.placed = true;
    if (run->new_cluster != 0) QCOWFS_CO_TRY(check_fresh(run->new_cluster, 1));
    if (s.host + s.csize - 1 > compressed_offset_mask(bits))
      co_return Status::errorf(EFBIG, "compressed cluster at host offset {:#x} is past what its L2 entry can name",
                               s.host);
  }
  co_return Status::ok();
}

std::vector<Qcow2Writer::HostWrite> Qcow2Writer::compressed_writes(Plan& plan,
                                                                   std::vector<io::AlignedBuffer>& bufs) const {
  std::vector<HostWrite> runs;
  const size_t align = img_.file->mem_align();
  for (size_t i = 0; i < plan.slots.size();) {
    if (plan.slots[i].kind != Kind::compressed) {
      ++i;
      continue;
    }
    // Slots i .. j-1: compressed streams each starting where the last ended.
    const HostOffset start = plan.slots[i].host;
    HostOffset end = start;
    size_t j = i;
    for (; j < plan.slots.size() && plan.slots[j].kind == Kind::compressed && plan.slots[j].host == end; ++j)
      end += plan.slots[j].csize;
    io::AlignedBuffer& b = bufs.emplace_back(static_cast<size_t>(end - start), align, false);
    for (size_t k = i; k < j; ++k)
      std::memcpy(b.data() + (plan.slots[k].host - start), plan.slots[k].packed.data(),
                  static_cast<size_t>(plan.slots[k].csize));
    runs.push_back(HostWrite{start, end - start, {iovec{b.data(), b.size()}}});
    i = j;
  }
  return runs;
}

Task<Status> Qcow2Writer::release_stream(const Slot& s) {
  const uint32_t bits = img_.geometry.cluster_bits;
  const HostCluster first_hc = s.host >> bits, last_hc = (s.host + s.csize - 1) >> bits;
  co_return co_await alloc_->release(first_hc, last_hc - first_hc + 1, nullptr);
}

// qemu-img convert -c ends with a zero-length compressed write, which rounds
// the file up to a whole 512-byte sector; so does this, at close.
Task<Status> Qcow2Writer::align_file_end() {
  io::HostFile& f = *img_.file;
  if (!compress_ || f.is_block_device() || is_aligned(f.size(), kCompressedSectorSize)) co_return Status::ok();
  co_return co_await f.truncate(align_up(f.size(), kCompressedSectorSize));
}

}  // namespace qcowfs::image::qcow2
