#include "image/qcow2/read_path.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "image/backing.h"
#include "io/align.h"
#include "io/buffer.h"
#include "io/engine.h"
#include "io/log.h"
#include "io/when_all.h"

namespace qcowfs::image::qcow2 {

// One host, backing or compressed read of a request.
struct ReadPath::SubRead {
  ExtentKind kind = ExtentKind::data;
  GuestOffset guest = 0;
  uint64_t host = 0;  // data: host offset; compressed: offset inside the cluster; else unused
  std::span<std::byte> dst;
  CompressedCluster compressed;
};

// Where a walk stands: the next guest offset and the end of the range.
struct ReadPath::Walk {
  GuestOffset guest = 0;
  GuestOffset end = 0;
};

Status ReadPath::corrupt(GuestOffset guest, const Status& why) const {
  log::error("{}{}: corrupt qcow2 metadata for guest offset {:#x}: {}", img_.path, snapshot_view_ ? " (snapshot)" : "",
             guest, why.message());
  return Status::errorf(EIO, "corrupt qcow2 metadata for guest offset {:#x}: {}", guest, why.message());
}

Result<HostOffset> ReadPath::l2_table_for(uint64_t l1_index, GuestOffset guest) const {
  if (l1_index >= l1_.entries.size()) return HostOffset{0};
  auto l2 = decode_l1_entry(img_.geometry, l1_.load(static_cast<size_t>(l1_index)));
  if (!l2) return corrupt(guest, l2.status());
  return *l2;
}

Task<Status> ReadPath::walk(GuestOffset guest, uint64_t len, RunVisitor visit) {
  const Geometry& g = img_.geometry;
  const uint64_t l2_entries = g.l2_entries();
  Walk w{guest, guest + len};
  while (w.guest < w.end) {
    const uint64_t l1_index = (w.guest >> g.cluster_bits) / l2_entries;
    auto l2 = l2_table_for(l1_index, w.guest);
    if (!l2) co_return l2.status();
    if (*l2 == 0) {  // the whole range of this L1 entry is unallocated
      const GuestOffset range_end = std::min(w.end, (l1_index + 1) * l2_entries * g.cluster_size());
      ClusterRun run;
      run.kind = ExtentKind::unallocated;
      run.length = range_end - w.guest;
      if (!visit(w.guest, run)) co_return Status::ok();
      w.guest = range_end;
      continue;
    }
    bool stop = false;
    QCOWFS_CO_TRY(co_await walk_slice(w, *l2, visit, &stop));
    if (stop) co_return Status::ok();
  }
  co_return Status::ok();
}

// The runs of one L2 slice (the one holding w.guest's entry), holding the
// slice pinned only while it is decoded.
Task<Status> ReadPath::walk_slice(Walk& w, HostOffset l2_table, RunVisitor& visit, bool* stop) {
  const Geometry& g = img_.geometry;
  const uint64_t cs = g.cluster_size();
  const uint64_t slice_entries = img_.l2_slice_entries();
  const size_t esz = g.l2_entry_size();
  const uint64_t l2_index = (w.guest >> g.cluster_bits) % g.l2_entries();
  const HostOffset slice_host = l2_table + (l2_index / slice_entries) * img_.l2_cache->slice_size();
  auto ref = img_.l2_cache->try_get(slice_host);  // no coroutine frame on a hit
  if (!ref) ref = co_await img_.l2_cache->get(slice_host);
  if (!ref) co_return ref.status().with_context(fmt::format("guest offset {:#x}", w.guest));
  for (uint64_t i = l2_index % slice_entries; i < slice_entries && w.guest < w.end; ++i) {
    const uint64_t entry = ref->be64(i * esz);
    const uint64_t bitmap = g.extended_l2 ? ref->be64(i * esz + kExtendedL2BitmapOffset) : 0;
    uint64_t in_cluster = w.guest & (cs - 1);
    const uint64_t stop_at = in_cluster + std::min(w.end - w.guest, cs - in_cluster);
    while (in_cluster < stop_at) {
      auto run = decode_cluster_run(g, entry, bitmap, in_cluster, stop_at - in_cluster);
      if (!run) co_return corrupt(w.guest, run.status());
      if (!visit(w.guest, *run)) {
        *stop = true;
        co_return Status::ok();
      }
      w.guest += run->length;
      in_cluster += run->length;
    }
  }
  co_return Status::ok();
}

Task<Status> ReadPath::read(GuestOffset guest, std::span<std::byte> buf) {
  if (!lock_reads_ || buf.empty()) co_return co_await read_unlocked(guest, buf);
  const uint64_t cs = img_.geometry.cluster_size();
  auto range = co_await ranges_.lock(align_down(guest, cs), align_up(guest + buf.size(), cs),
                                     io::RangeLock::Mode::shared);
  co_return co_await read_unlocked(guest, buf);
}

Task<Status> ReadPath::read_unlocked(GuestOffset guest, std::span<std::byte> buf) {
  std::vector<SubRead> plan;
  QCOWFS_CO_TRY(co_await plan_reads(guest, buf, plan));
  if (plan.size() == 1) co_return co_await run_sub_read(plan.front());
  std::vector<Task<Status>> tasks;
  tasks.reserve(plan.size());
  for (const SubRead& r : plan) tasks.push_back(run_sub_read(r));
  co_return co_await io::when_all(std::move(tasks));
}

// The host, backing and compressed reads of [start, start + buf.size()),
// coalesced; zero runs are filled in buf at once.
Task<Status> ReadPath::plan_reads(GuestOffset start, std::span<std::byte> buf, std::vector<SubRead>& plan) {
  BlockDriver* backing = img_.backing.get();
  const uint64_t cs = img_.geometry.cluster_size();
  auto extends_last = [&](ExtentKind kind, GuestOffset guest) {
    return !plan.empty() && plan.back().kind == kind && plan.back().guest + plan.back().dst.size() == guest;
  };
  auto grow_last = [&](uint64_t len) {
    plan.back().dst = std::span<std::byte>(plan.back().dst.data(), plan.back().dst.size() + len);
  };
  co_return co_await walk(start, buf.size(), [&](GuestOffset guest, const ClusterRun& r) {
    std::span<std::byte> dst = buf.subspan(guest - start, r.length);
    switch (r.kind) {
      case ExtentKind::zero:
        std::memset(dst.data(), 0, dst.size());
        break;
      case ExtentKind::unallocated:
        if (backing == nullptr || guest >= backing->size()) {
          std::memset(dst.data(), 0, dst.size());
        } else if (extends_last(ExtentKind::unallocated, guest)) {
          grow_last(r.length);
        } else {
          plan.push_back(SubRead{ExtentKind::unallocated, guest, 0, dst, {}});
        }
        break;
      case ExtentKind::data:
        if (extends_last(ExtentKind::data, guest) && plan.back().host + plan.back().dst.size() == r.host_offset) {
          grow_last(r.length);
        } else {
          plan.push_back(SubRead{ExtentKind::data, guest, r.host_offset, dst, {}});
        }
        break;
      case ExtentKind::compressed:
        plan.push_back(SubRead{ExtentKind::compressed, guest, guest & (cs - 1), dst, r.compressed});
        break;
    }
    return true;
  });
}

Task<Status> ReadPath::run_sub_read(SubRead r) {
  switch (r.kind) {
    case ExtentKind::data: co_return co_await read_data(r);
    case ExtentKind::unallocated: co_return co_await read_backing(r.guest, r.dst);
    case ExtentKind::compressed: co_return co_await read_compressed(r.compressed, r.host, r.dst);
    case ExtentKind::zero: break;
  }
  std::memset(r.dst.data(), 0, r.dst.size());
  co_return Status::ok();
}

// Guest data from its host clusters: through the cipher on an encrypted
// image (LUKS: data_io decrypts with the host offset; legacy AES here with
// the guest offset, the request whole sectors: Qcow2Driver::read aligns it).
Task<Status> ReadPath::read_data(const SubRead& r) {
  QCOWFS_CO_TRY(co_await read_host(*img_.data_io, r.host, r.dst));
  if (img_.legacy_cipher) co_return co_await crypto::decrypt_async(*img_.legacy_cipher, r.guest, r.dst);
  co_return Status::ok();
}

Task<Status> ReadPath::read_host(io::HostFile& f, HostOffset host, std::span<std::byte> dst) {
  auto n = co_await f.read(host, dst);
  if (!n) co_return n.status();
  // Past the end of the host file a cluster reads as zeros (as in QEMU).
  if (*n < dst.size()) std::memset(dst.data() + *n, 0, dst.size() - *n);
  co_return Status::ok();
}

Task<Status> ReadPath::read_backing(GuestOffset guest, std::span<std::byte> dst) {
  co_return co_await read_backing_range(*img_.backing, guest, dst);
}

Task<Status> ReadPath::read_compressed(CompressedCluster c, uint64_t in_cluster, std::span<std::byte> dst) {
  auto cl = co_await load_compressed(c);
  if (!cl) co_return cl.status();
  std::memcpy(dst.data(), (*cl)->data() + in_cluster, dst.size());
  co_return Status::ok();
}

Task<Result<ClusterCache::Cluster>> ReadPath::load_compressed(CompressedCluster c) {
  if (auto hit = img_.cluster_cache->find(c.host_offset)) co_return hit;
  io::HostFile& f = *img_.file;
  io::AlignedBuffer in(static_cast<size_t>(c.size), f.mem_align(), false);
  auto n = co_await f.read(c.host_offset, in.span());
  if (!n) co_return n.status();
  // The last sector of the stream may reach past the end of the file.
  if (*n < in.size()) std::memset(in.data() + *n, 0, in.size() - *n);
  auto cluster = co_await decompress(c, in);
  if (cluster) img_.cluster_cache->insert(c.host_offset, *cluster);
  co_return cluster;
}

// Decompresses on a worker thread (io::offload).
Task<Result<ClusterCache::Cluster>> ReadPath::decompress(CompressedCluster c, const io::AlignedBuffer& in) {
  auto out = std::make_shared<io::AlignedBuffer>(static_cast<size_t>(img_.geometry.cluster_size()), io::kMinMemAlign,
                                                 false);
  const uint8_t type = img_.header.compression_type;
  Status result;
  int64_t r = co_await io::offload([&]() -> int64_t {
    result = decompress_cluster(type, in.span(), out->span());
    return result.is_ok() ? 0 : -EIO;
  });
  if (!result) {
    log::error("{}: corrupt compressed cluster at host offset {:#x}: {}", img_.path, c.host_offset, result.message());
    co_return Status::errorf(EIO, "corrupt compressed cluster at host offset {:#x}: {}", c.host_offset,
                             result.message());
  }
  if (r < 0) co_return Status::from_errno(static_cast<int>(r), "decompressing a cluster");
  ClusterCache::Cluster cluster = std::move(out);
  co_return cluster;
}

}  // namespace qcowfs::image::qcow2
