#include "image/qcow2/alloc.h"

#include <algorithm>

#include "io/align.h"

namespace qcowfs::image::qcow2 {

Task<Result<HostCluster>> ClusterAllocator::find_free_run(uint64_t n) {
  if (hint_ >= end_ || (failed_n_ != 0 && n >= failed_n_)) co_return end_;
  HostCluster first_free = end_, run_start = 0;
  uint64_t run = 0;
  for (HostCluster hc = hint_; hc < end_;) {
    auto v = rt_.peek(hc);
    if (!v) {
      QCOWFS_CO_TRY(co_await rt_.load_block_for(hc));
      continue;
    }
    if (*v != 0) {
      run = 0;
      ++hc;
      continue;
    }
    if (run++ == 0) run_start = hc;
    first_free = std::min(first_free, hc);
    ++hc;
    if (run == n) {
      hint_ = first_free == run_start ? run_start + n : first_free;
      co_return run_start;
    }
  }
  // A free run reaching the end continues into the unused area.
  hint_ = first_free;
  if (run > 0) co_return run_start;
  failed_n_ = failed_n_ == 0 ? n : std::min(failed_n_, n);
  co_return end_;
}

Task<Result<HostCluster>> ClusterAllocator::allocate(uint64_t n) {
  const uint64_t per = rt_.block_entries();
  for (;;) {
    auto start = co_await find_free_run(n);
    if (!start) co_return start.status();
    uint64_t first_index = *start / per, last_index = (*start + n - 1) / per;
    if (last_index >= rt_.table_entries()) {
      grow_to_entries_ = last_index + 1;
      co_return Status::error(EAGAIN, "the refcount table must grow");
    }
    uint64_t missing = UINT64_MAX;
    for (uint64_t r = first_index; r <= last_index && missing == UINT64_MAX; ++r)
      if (!rt_.has_block(r)) missing = r;
    if (missing == UINT64_MAX) {
      QCOWFS_CO_TRY(co_await rt_.add(*start, n, +1));
      end_ = std::max(end_, *start + n);
      if (hint_ == *start) hint_ = *start + n;
      co_return *start;
    }
    // Put the missing block on the run's first cluster. That cluster is counted
    // by its own block: create that one first if it is the missing one.
    HostCluster place = *start;
    rt_.install_block(rt_.has_block(first_index) ? missing : first_index, place);
    QCOWFS_CO_TRY(co_await rt_.add(place, 1, +1));
    end_ = std::max(end_, place + 1);
    if (hint_ == place) hint_ = place + 1;
  }
}

Task<Status> ClusterAllocator::grow_table() {
  if (grow_to_entries_ <= rt_.table_entries()) co_return Status::ok();
  const HostCluster old_first_hc = rt_.table_offset() / rt_.cluster_size();
  auto next = co_await rt_.grow(grow_to_entries_, end_);
  if (!next) co_return next.status();
  end_ = *next;
  set_hint(old_first_hc);
  grow_to_entries_ = 0;
  co_return Status::ok();
}

Task<Status> ClusterAllocator::release(HostCluster first_hc, uint64_t n, std::vector<HostCluster>* freed) {
  QCOWFS_CO_TRY(co_await rt_.add(first_hc, n, -1));
  for (HostCluster hc = first_hc; hc < first_hc + n; ++hc) {
    auto v = rt_.peek(hc);
    if (v && *v == 0) {
      set_hint(hc);
      if (free_byte_ != 0 && (free_byte_ >> rt_.map().cluster_bits()) == hc) free_byte_ = 0;
      if (freed) freed->push_back(hc);
    }
  }
  co_return Status::ok();
}

// QEMU's qcow2_alloc_bytes (block/qcow2-refcount.c, 7.2).
Task<Result<ClusterAllocator::ByteRun>> ClusterAllocator::allocate_bytes(uint64_t size) {
  const uint64_t cs = rt_.cluster_size();
  const uint32_t bits = rt_.map().cluster_bits();
  if (size == 0 || size >= cs) co_return Status::errorf(EINVAL, "compressed cluster of {} bytes", size);
  HostOffset offset = free_byte_;
  if (offset != 0) {
    auto refs = co_await rt_.get(offset >> bits);
    if (!refs) co_return refs.status();
    // At the maximum it cannot take another reference; at 0 it was freed
    // (and may have been handed out whole since).
    if (*refs == 0 || *refs >= rt_.map().max()) offset = 0;
  }
  ByteRun run;
  if (offset == 0 || cs - (offset & (cs - 1)) < size) {
    auto hc = co_await allocate(1);  // refcount 1: the new cluster's reference
    if (!hc) co_return hc.status();
    run.new_cluster = *hc;
    const HostOffset fresh = *hc << bits;
    if (offset == 0 || align_up(offset, cs) != fresh) {
      offset = fresh;  // the old cluster's tail stays unused
    } else {
      QCOWFS_CO_TRY(co_await rt_.add(offset >> bits, 1, +1));  // the stream starts in the old cluster
    }
  } else {
    QCOWFS_CO_TRY(co_await rt_.add(offset >> bits, 1, +1));
  }
  run.offset = offset;
  free_byte_ = ((offset + size) & (cs - 1)) != 0 ? offset + size : 0;
  co_return run;
}

void ClusterAllocator::set_hint(HostCluster hc) {
  hint_ = std::min(hint_, hc);
  failed_n_ = 0;
}

}  // namespace qcowfs::image::qcow2
