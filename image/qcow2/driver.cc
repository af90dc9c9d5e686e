// qcow2 driver: opening (header, L1 table, snapshot table, data file, backing
// chain) and the read-only mapping of guest requests onto host reads.
#include "image/qcow2/qcow2.h"

#include <limits.h>
#include <stdlib.h>

#include <algorithm>
#include <cstring>

#include "image/endian.h"
#include "image/path.h"
#include "image/qcow2/driver.h"
#include "image/qcow2/status.h"
#include "image/qcow2/writer.h"
#include "image/shrink.h"
#include "io/align.h"
#include "io/buffer.h"
#include "io/engine.h"
#include "io/log.h"
#include "io/when_all.h"

namespace qcowfs::image {
namespace qcow2 {
namespace {

constexpr std::string_view kReadOnly = "the qcow2 image is open read-only";

// Upper bound on runs one block_status() call walks, so a query over a huge
// fragmented range stays short; callers continue from the returned length.
constexpr size_t kMaxStatusRuns = 65536;

std::string real_path(const std::string& path) {
  char buf[PATH_MAX];
  if (::realpath(path.c_str(), buf) == nullptr) return path;
  return buf;
}

Task<Result<io::AlignedBuffer>> read_exact(io::HostFile& f, uint64_t off, size_t len, bool zero_past_eof,
                                           std::string_view what) {
  io::AlignedBuffer buf(len, f.mem_align(), zero_past_eof);
  auto n = co_await f.read(buf.span(), off);
  if (!n) co_return n.status().with_context(fmt::format("reading {}", what));
  if (*n < len && !zero_past_eof)
    co_return Status::errorf(EINVAL, "{} at {:#x} ({} bytes) is truncated by the end of the file", what, off, len);
  co_return buf;
}

Task<Result<Header>> read_header(io::HostFile& f) {
  auto probe = co_await read_exact(f, 0, kHeaderProbeBytes, true, "qcow2 header");
  if (!probe) co_return probe.status();
  auto cs = header_cluster_size(probe->span().first(std::min<uint64_t>(f.size(), kHeaderProbeBytes)));
  if (!cs) co_return cs.status();
  auto cluster0 = co_await read_exact(f, 0, static_cast<size_t>(*cs), true, "qcow2 header cluster");
  if (!cluster0) co_return cluster0.status();
  co_return parse_header(cluster0->span(), f.size());
}

Task<Result<L1Table>> read_l1(io::HostFile& f, uint64_t offset, uint32_t entries) {
  L1Table l1;
  l1.host_offset = offset;
  if (entries == 0) co_return l1;
  auto buf = co_await read_exact(f, offset, size_t{entries} * 8, false, "L1 table");
  if (!buf) co_return buf.status();
  l1.entries.resize(entries);
  for (size_t i = 0; i < entries; ++i) l1.entries[i] = load_be64(buf->data() + i * 8);
  co_return l1;
}

Task<Result<std::vector<Snapshot>>> read_snapshots(io::HostFile& f, const Header& h) {
  if (h.nb_snapshots == 0) co_return std::vector<Snapshot>{};
  uint64_t file_size = f.size();
  uint64_t want = std::min<uint64_t>(64 * 1024, file_size - h.snapshots_offset);
  for (;;) {
    auto buf = co_await read_exact(f, h.snapshots_offset, static_cast<size_t>(want), false, "snapshot table");
    if (!buf) co_return buf.status();
    auto t = parse_snapshot_table(buf->span(), h, file_size);
    if (!t) co_return t.status();
    if (t->needed_bytes == 0) co_return std::move(t->snapshots);
    // parse_snapshot_table bounds needed_bytes by the file and the table limit.
    want = std::min(std::max(t->needed_bytes, want * 2), std::min(kMaxSnapshotTableBytes, file_size - h.snapshots_offset));
  }
}

Task<Status> open_data_file(Qcow2Image& img, const ImageOptions& opts) {
  if (!img.header.has_external_data_file()) {
    img.data_file = img.file.get();
    co_return Status::ok();
  }
  std::string dpath = resolve_relative(img.path, img.header.data_file);
  auto f = io::open_host_file(dpath, opts.file);
  if (!f) co_return f.status().with_context(fmt::format("opening external data file of {}", img.path));
  img.data_file_owned = std::move(*f);
  img.data_file = img.data_file_owned.get();
  co_return Status::ok();
}

Task<Status> open_backing(Qcow2Image& img, const ImageOptions& opts, const std::string& self_real) {
  if (img.header.backing_file.empty()) co_return Status::ok();
  std::string bpath = resolve_relative(img.path, img.header.backing_file);
  ImageOptions b;
  b.format = img.header.backing_format;
  b.file = opts.file;
  b.file.writable = false;
  b.l2_cache_size = opts.l2_cache_size;
  b.backing_chain = opts.backing_chain;
  b.backing_chain.push_back(self_real);
  b.backing_of = img.path;
  auto d = co_await open_image(bpath, std::move(b));
  if (!d) co_return d.status().with_context(fmt::format("opening backing file '{}' of {}", bpath, img.path));
  img.backing = std::move(*d);
  co_return Status::ok();
}

void setup_caches(Qcow2Image& img, const ImageOptions& opts) {
  const Header& h = img.header;
  size_t slice = static_cast<size_t>(std::min<uint64_t>(L2Cache::kDefaultSliceSize, h.cluster_size()));
  uint64_t whole_disk = h.l1_entries_for(h.size) * h.cluster_size();
  uint64_t bytes = opts.l2_cache_size != 0 ? opts.l2_cache_size : L2Cache::default_size(whole_disk, slice);
  img.l2_cache = std::make_unique<L2Cache>(*img.file, slice, bytes);
  img.cluster_cache = std::make_unique<ClusterCache>(ClusterCache::default_capacity(h.cluster_size()));
}

void log_feature_state(const Header& h, const std::string& path) {
  if (h.corrupt()) log::warn("{}: image is marked corrupt; opened read-only, data may be wrong", path);
  if (h.dirty()) log::info("{}: image was not closed cleanly (dirty bit): refcounts are not trusted", path);
}

Task<Result<std::unique_ptr<BlockDriver>>> open_impl(std::unique_ptr<io::HostFile> file, std::string path,
                                                     ImageOptions opts) {
  const bool writable = opts.file.writable && file->writable();
  if (writable && !opts.snapshot.empty())
    co_return Status::error(EROFS, "snapshots are read-only: open them without write access");
  std::string self_real = real_path(path);
  if (std::find(opts.backing_chain.begin(), opts.backing_chain.end(), self_real) != opts.backing_chain.end())
    co_return Status::errorf(ELOOP, "backing chain loop: {} is its own backing file", self_real);
  auto img = std::make_shared<Qcow2Image>();
  img->path = path;
  img->file = std::move(file);
  auto h = co_await read_header(*img->file);
  if (!h) co_return h.status();
  img->header = std::move(*h);
  if (Status st = check_features(img->header, writable); !st) {
    if (writable && img->header.corrupt()) log::error("{}: {}", path, st.message());
    co_return st;
  }
  log_feature_state(img->header, path);
  // A writable image grows while it is open: file-size range checks on
  // entries would reject what the writer just allocated.
  img->geometry = Geometry{img->header.cluster_bits, img->header.extended_l2(),
                           img->header.has_external_data_file(),
                           writable ? kMaxHostOffset : img->file->size()};
  setup_caches(*img, opts);
  auto l1 = co_await read_l1(*img->file, img->header.l1_table_offset, img->header.l1_size);
  if (!l1) co_return l1.status();
  auto sn = co_await read_snapshots(*img->file, img->header);
  if (!sn) co_return sn.status();
  img->snapshots = std::move(*sn);
  QCOWFS_CO_TRY(co_await open_data_file(*img, opts));
  QCOWFS_CO_TRY(co_await open_backing(*img, opts, self_real));
  uint64_t size = img->header.size;
  auto drv = std::make_unique<Qcow2Driver>(std::move(img), std::move(*l1), size, false);
  if (writable) QCOWFS_CO_TRY(co_await drv->enable_writes(opts));
  if (!opts.snapshot.empty()) co_return co_await drv->open_snapshot(opts.snapshot);
  std::unique_ptr<BlockDriver> out = std::move(drv);
  co_return out;
}

}  // namespace

// ---- Qcow2Driver ----

// One host, backing or compressed read of a request.
struct Qcow2Driver::SubRead {
  RunKind kind = RunKind::data;
  uint64_t guest = 0;
  uint64_t host = 0;  // data: host offset; compressed: offset inside the cluster; else unused
  std::span<std::byte> dst;
  CompressedCluster compressed;
};

Qcow2Driver::Qcow2Driver(std::shared_ptr<Qcow2Image> image, L1Table l1, uint64_t size, bool snapshot_view)
    : image_(std::move(image)), l1_(std::move(l1)), size_(size), snapshot_view_(snapshot_view) {}

Qcow2Driver::~Qcow2Driver() = default;

uint64_t Qcow2Driver::size() const { return writer_ ? writer_->size() : size_; }

Task<Status> Qcow2Driver::enable_writes(const ImageOptions& opts) {
  auto layout = co_await build_metadata_layout(*image_->file, image_->header, l1_.entries, image_->snapshots);
  if (!layout) co_return co_await signal_corruption(*image_, layout.status().message());
  image_->layout = std::move(*layout);
  auto w = co_await Qcow2Writer::open(
      *image_, l1_, [this](uint64_t off, std::span<std::byte> dst) { return read_unlocked(off, dst); }, opts);
  if (!w) co_return w.status();
  writer_ = std::move(*w);
  co_return Status::ok();
}

Status Qcow2Driver::refuse_corrupt() const {
  return Status::errorf(EIO, "{}: image is marked corrupt; writes are refused", image_->path);
}

Status Qcow2Driver::corrupt(uint64_t guest, const Status& why) const {
  log::error("{}{}: corrupt qcow2 metadata for guest offset {:#x}: {}", image_->path,
             snapshot_view_ ? " (snapshot)" : "", guest, why.message());
  return Status::errorf(EIO, "corrupt qcow2 metadata for guest offset {:#x}: {}", guest, why.message());
}

Result<uint64_t> Qcow2Driver::l2_table_for(uint64_t l1_index, uint64_t guest) {
  if (l1_index >= l1_.entries.size()) return uint64_t{0};
  auto l2 = decode_l1_entry(image_->geometry, l1_.load(static_cast<size_t>(l1_index)));
  if (!l2) return corrupt(guest, l2.status());
  return *l2;
}

Task<Status> Qcow2Driver::walk(uint64_t off, uint64_t len, RunVisitor visit) {
  const Geometry& g = image_->geometry;
  const uint64_t cs = g.cluster_size();
  const uint64_t l2_entries = g.l2_entries();
  const uint64_t slice_entries = image_->l2_slice_entries();
  const size_t esz = g.l2_entry_size();
  uint64_t pos = off;
  const uint64_t end = off + len;
  while (pos < end) {
    uint64_t cluster = pos >> g.cluster_bits;
    uint64_t l1_index = cluster / l2_entries, l2_index = cluster % l2_entries;
    auto l2 = l2_table_for(l1_index, pos);
    if (!l2) co_return l2.status();
    if (*l2 == 0) {  // the whole range of this L1 entry is unallocated
      uint64_t range_end = std::min(end, (l1_index + 1) * l2_entries * cs);
      ClusterRun run;
      run.kind = RunKind::unallocated;
      run.length = range_end - pos;
      if (!visit(pos, run)) co_return Status::ok();
      pos = range_end;
      continue;
    }
    uint64_t slice_off = *l2 + (l2_index / slice_entries) * image_->l2_cache->slice_size();
    auto ref = image_->l2_cache->try_get(slice_off);  // no coroutine frame on a hit
    if (!ref) ref = co_await image_->l2_cache->get(slice_off);
    if (!ref) co_return ref.status().with_context(fmt::format("guest offset {:#x}", pos));
    for (uint64_t i = l2_index % slice_entries; i < slice_entries && pos < end; ++i) {
      uint64_t entry = ref->entry(i, esz);
      uint64_t bitmap = g.extended_l2 ? ref->bitmap(i, esz) : 0;
      uint64_t in_cluster = pos & (cs - 1);
      uint64_t stop = in_cluster + std::min(end - pos, cs - in_cluster);
      while (in_cluster < stop) {
        auto run = decode_cluster_run(g, entry, bitmap, in_cluster, stop - in_cluster);
        if (!run) co_return corrupt(pos, run.status());
        if (!visit(pos, *run)) co_return Status::ok();
        pos += run->length;
        in_cluster += run->length;
      }
    }
  }
  co_return Status::ok();
}

Task<Status> Qcow2Driver::read(uint64_t off, std::span<std::byte> buf) {
  if (!writer_ || buf.empty()) co_return co_await read_unlocked(off, buf);
  const uint64_t cs = image_->geometry.cluster_size();
  auto range = co_await writer_->ranges().lock(align_down(off, cs), align_up(off + buf.size(), cs),
                                                io::RangeLock::Mode::shared);
  co_return co_await read_unlocked(off, buf);
}

Task<Status> Qcow2Driver::read_unlocked(uint64_t off, std::span<std::byte> buf) {
  std::vector<SubRead> plan;
  BlockDriver* backing = image_->backing.get();
  const uint64_t cs = image_->geometry.cluster_size();
  auto extends_last = [&](RunKind kind, uint64_t guest) {
    return !plan.empty() && plan.back().kind == kind && plan.back().guest + plan.back().dst.size() == guest;
  };
  auto grow_last = [&](uint64_t len) {
    plan.back().dst = std::span<std::byte>(plan.back().dst.data(), plan.back().dst.size() + len);
  };
  Status st = co_await walk(off, buf.size(), [&](uint64_t guest, const ClusterRun& r) {
    std::span<std::byte> dst = buf.subspan(guest - off, r.length);
    switch (r.kind) {
      case RunKind::zero:
        std::memset(dst.data(), 0, dst.size());
        break;
      case RunKind::unallocated:
        if (backing == nullptr || guest >= backing->size()) {
          std::memset(dst.data(), 0, dst.size());
        } else if (extends_last(RunKind::unallocated, guest)) {
          grow_last(r.length);
        } else {
          plan.push_back(SubRead{RunKind::unallocated, guest, 0, dst, {}});
        }
        break;
      case RunKind::data:
        if (extends_last(RunKind::data, guest) && plan.back().host + plan.back().dst.size() == r.host_offset) {
          grow_last(r.length);
        } else {
          plan.push_back(SubRead{RunKind::data, guest, r.host_offset, dst, {}});
        }
        break;
      case RunKind::compressed:
        plan.push_back(SubRead{RunKind::compressed, guest, guest & (cs - 1), dst, r.compressed});
        break;
    }
    return true;
  });
  if (!st) co_return st;
  if (plan.size() == 1) co_return co_await run_sub_read(plan.front());
  std::vector<Task<Status>> tasks;
  tasks.reserve(plan.size());
  for (const SubRead& r : plan) tasks.push_back(run_sub_read(r));
  co_return co_await io::when_all(std::move(tasks));
}

Task<Status> Qcow2Driver::run_sub_read(SubRead r) {
  switch (r.kind) {
    case RunKind::data: co_return co_await read_host(*image_->data_file, r.host, r.dst);
    case RunKind::unallocated: co_return co_await read_backing(r.guest, r.dst);
    case RunKind::compressed: co_return co_await read_compressed(r.compressed, r.host, r.dst);
    case RunKind::zero: break;
  }
  std::memset(r.dst.data(), 0, r.dst.size());
  co_return Status::ok();
}

Task<Status> Qcow2Driver::read_host(io::HostFile& f, uint64_t host, std::span<std::byte> dst) {
  auto n = co_await f.read(dst, host);
  if (!n) co_return n.status();
  // Past the end of the host file a cluster reads as zeros (as in QEMU).
  if (*n < dst.size()) std::memset(dst.data() + *n, 0, dst.size() - *n);
  co_return Status::ok();
}

Task<Status> Qcow2Driver::read_backing(uint64_t guest, std::span<std::byte> dst) {
  BlockDriver& b = *image_->backing;
  uint64_t bsize = b.size();
  uint64_t n = guest < bsize ? std::min<uint64_t>(dst.size(), bsize - guest) : 0;
  if (n < dst.size()) std::memset(dst.data() + n, 0, dst.size() - n);
  if (n == 0) co_return Status::ok();
  co_return co_await b.read(guest, dst.first(n));
}

Task<Status> Qcow2Driver::read_compressed(CompressedCluster c, uint64_t in_cluster, std::span<std::byte> dst) {
  auto cl = co_await load_compressed(c);
  if (!cl) co_return cl.status();
  std::memcpy(dst.data(), (*cl)->data() + in_cluster, dst.size());
  co_return Status::ok();
}

Task<Result<ClusterCache::Cluster>> Qcow2Driver::load_compressed(CompressedCluster c) {
  if (auto hit = image_->cluster_cache->find(c.host_offset)) co_return hit;
  io::HostFile& f = *image_->file;
  io::AlignedBuffer in(static_cast<size_t>(c.size), f.mem_align(), false);
  auto n = co_await f.read(in.span(), c.host_offset);
  if (!n) co_return n.status();
  // The last sector of the stream may reach past the end of the file.
  if (*n < in.size()) std::memset(in.data() + *n, 0, in.size() - *n);
  auto out = std::make_shared<io::AlignedBuffer>(static_cast<size_t>(image_->geometry.cluster_size()), io::kMinMemAlign,
                                                 false);
  uint8_t type = image_->header.compression_type;
  Status result;
  int64_t r = co_await io::offload([&]() -> int64_t {
    result = decompress_cluster(type, in.span(), out->span());
    return result.is_ok() ? 0 : -EIO;
  });
  if (!result) {
    log::error("{}: corrupt compressed cluster at host offset {:#x}: {}", image_->path, c.host_offset,
               result.message());
    co_return Status::errorf(EIO, "corrupt compressed cluster at host offset {:#x}: {}", c.host_offset,
                             result.message());
  }
  if (r < 0) co_return Status::from_errno(static_cast<int>(r), "decompressing a cluster");
  ClusterCache::Cluster cluster = std::move(out);
  image_->cluster_cache->insert(c.host_offset, cluster);
  co_return cluster;
}

namespace {

// Runs that qemu-img map would report as one range: same kind, and host
// offsets that continue each other where the clusters name host clusters.
bool continues_status(const ClusterRun& first, uint64_t length, const ClusterRun& r) {
  if (r.kind != first.kind || r.mapped != first.mapped) return false;
  return !first.mapped || first.host_offset + length == r.host_offset;
}

// QEMU's guess whether the image was made with preallocation=metadata, made
// once per image. Only for images open read-only: a writable image's on-disk
// refcounts lag behind its writer, and its header changes under the writer's
// lock; a mount only asks for data versus holes, which the guess never changes.
Task<bool> metadata_preallocated(Qcow2Image& img) {
  using Guess = Qcow2Image::PreallocGuess;
  if (img.file->writable()) co_return false;
  Guess g = img.metadata_prealloc.load(std::memory_order_acquire);
  if (g == Guess::unknown) {
    auto r = co_await detect_metadata_preallocation(*img.file, img.header);
    g = r && *r ? Guess::yes : Guess::no;  // as in QEMU, a failed guess is a no
    img.metadata_prealloc.store(g, std::memory_order_release);
  }
  co_return g == Guess::yes;
}

}  // namespace

Task<Result<BlockStatus>> Qcow2Driver::block_status(uint64_t off, uint64_t len) {
  len = std::min(len, size() - std::min(off, size()));
  if (len == 0) co_return Status::errorf(EINVAL, "block status query at {:#x} is beyond the end of the image", off);
  ClusterRun first;
  uint64_t length = 0;
  size_t runs = 0;
  Status st = co_await walk(off, len, [&](uint64_t, const ClusterRun& r) {
    if (runs > 0 && (!continues_status(first, length, r) || runs >= kMaxStatusRuns)) return false;
    if (runs == 0) first = r;
    length += r.length;
    ++runs;
    return true;
  });
  if (!st) co_return st;
  BlockDriver* backing = image_->backing.get();
  if (first.kind == RunKind::unallocated && backing != nullptr && off < backing->size())
    co_return co_await backing_status(off, length);
  BlockStatus b;
  b.length = length;
  // Unallocated with nothing below: zeros that no layer records.
  b.present = first.kind != RunKind::unallocated;
  b.data = first.kind == RunKind::data || first.kind == RunKind::compressed;
  b.zero = first.kind == RunKind::zero || first.kind == RunKind::unallocated;
  if (first.mapped) {
    b.file = image_->data_file;
    b.host_offset = first.host_offset;
  }
  if (first.kind == RunKind::data && co_await metadata_preallocated(*image_))
    QCOWFS_CO_TRY(co_await apply_host_holes(*image_->data_file, b));
  co_return b;
}

Task<Result<BlockStatus>> Qcow2Driver::backing_status(uint64_t off, uint64_t len) {
  BlockDriver& backing = *image_->backing;
  auto r = co_await backing.block_status(off, std::min(len, backing.size() - off));
  if (!r) co_return r.status();
  r->depth += 1;
  co_return r;
}

Task<Status> Qcow2Driver::write(uint64_t off, std::span<const std::byte> buf) {
  if (!writer_) co_return Status::error(EROFS, std::string(kReadOnly));
  if (image_->corrupt) co_return refuse_corrupt();
  co_return co_await writer_->write(off, buf);
}
Task<Status> Qcow2Driver::flush() {
  if (!writer_) co_return Status::ok();
  co_return co_await writer_->flush();
}
Task<Status> Qcow2Driver::discard(uint64_t off, uint64_t len) {
  if (!writer_) co_return Status::error(EROFS, std::string(kReadOnly));
  if (image_->corrupt) co_return refuse_corrupt();
  co_return co_await writer_->discard(off, len);
}
Task<Status> Qcow2Driver::write_zeroes(uint64_t off, uint64_t len, bool may_unmap) {
  if (!writer_) co_return Status::error(EROFS, std::string(kReadOnly));
  if (image_->corrupt) co_return refuse_corrupt();
  co_return co_await writer_->write_zeroes(off, len, may_unmap);
}
Task<Status> Qcow2Driver::truncate(uint64_t new_size) {
  if (!writer_) co_return Status::error(EROFS, std::string(kReadOnly));
  if (image_->corrupt) co_return refuse_corrupt();
  // Data a backing file shows past the new end counts too (the writer checks this layer).
  if (new_size < size()) QCOWFS_CO_TRY(co_await check_shrink(*this, new_size));
  co_return co_await writer_->truncate(new_size);
}
Task<Status> Qcow2Driver::close() {
  if (!writer_) co_return Status::ok();
  co_return co_await writer_->close();
}
Task<Status> Qcow2Driver::idle_writeback() {
  if (!writer_) co_return Status::ok();
  co_return co_await writer_->idle_writeback();
}

uint64_t Qcow2Driver::allocated_bytes() const {
  uint64_t n = image_->file->allocated_bytes();
  if (image_->data_file_owned) n += image_->data_file_owned->allocated_bytes();
  return n;
}

std::vector<SnapshotInfo> Qcow2Driver::snapshots() const {
  std::vector<SnapshotInfo> out;
  for (const Snapshot& s : image_->snapshots)
    out.push_back(SnapshotInfo{s.id, s.name, s.disk_size, s.vm_state_size, s.date_sec, s.date_nsec, s.vm_clock_nsec});
  return out;
}

Task<Result<std::unique_ptr<BlockDriver>>> Qcow2Driver::open_snapshot(std::string id_or_name) {
  int i = find_snapshot(image_->snapshots, id_or_name);
  if (i < 0) co_return Status::errorf(ENOENT, "{}: no snapshot with ID or name '{}'", image_->path, id_or_name);
  const Snapshot& s = image_->snapshots[static_cast<size_t>(i)];
  if (image_->header.l1_entries_for(s.disk_size) > kMaxL1Bytes / 8)
    co_return Status::errorf(EINVAL, "{}: snapshot '{}' has an absurd disk size {}", image_->path, id_or_name,
                             s.disk_size);
  auto l1 = co_await read_l1(*image_->file, s.l1_table_offset, s.l1_size);
  if (!l1) co_return l1.status().with_context(fmt::format("{}: snapshot '{}'", image_->path, id_or_name));
  std::unique_ptr<BlockDriver> d = std::make_unique<Qcow2Driver>(image_, std::move(*l1), s.disk_size, true);
  co_return d;
}

}  // namespace qcow2

Task<Result<std::unique_ptr<BlockDriver>>> open_qcow2(std::unique_ptr<io::HostFile> file, std::string path,
                                                      ImageOptions opts) {
  auto d = co_await qcow2::open_impl(std::move(file), path, std::move(opts));
  if (!d) co_return d.status().with_context(path);
  co_return d;
}

}  // namespace qcowfs::image
