#include "fuse/fuse_ring.h"

#include <linux/fuse.h>
#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "io/log.h"

namespace qcowfs::fuse {

namespace {
// The header buffer and the message prefix share the page before the payload.
constexpr size_t kPrefixBytes = 4096;
static_assert(sizeof(uring_abi::ReqHeader) + sizeof(fuse_in_header) + uring_abi::kOpInBytes <= kPrefixBytes);
static_assert(kHugePayloadMin <= io::kHugePageSize);

// Completions that mean the connection is going away, not that something broke.
bool connection_ended(int64_t res) { return res == -ENOTCONN || res == -ECANCELED || res == -ECONNABORTED; }
}  // namespace

// An entry's memory: 4 MiB of the ring's one mapping (FuseRing::memory_); the
// payload starts on a huge-page boundary (2 MiB of its own), the prefix page
// sits just below it. Nothing is touched until used.
struct FuseRing::Entry : io::IoRequest {
  FuseRing* ring = nullptr;
  uint16_t qid = 0;
  std::byte* mem = nullptr;
  iovec iovs[2] = {};
  uring_abi::CmdReq cmd = {};
  bool registered = false;  // the kernel accepted this entry at least once
  bool huge = false;        // use_huge_payload() has decided this entry's pages
  bool huge_on_reply = false;  // decide once the WRITE it holds has replied

  std::byte* prefix() { return mem + io::kHugePageSize - kPrefixBytes; }
  uring_abi::ReqHeader* header() { return reinterpret_cast<uring_abi::ReqHeader*>(prefix()); }
  std::byte* payload() { return mem + io::kHugePageSize; }
};

FuseRing::FuseRing(Config cfg) : cfg_(std::move(cfg)) {}

// Entries are only freed once the engine that registered them is gone (see
// EventLoop::thread_main): the kernel writes requests into them until then.
FuseRing::~FuseRing() = default;

Status FuseRing::start() {
  if (cfg_.payload_bytes > io::kHugePageSize) return Status::error(EINVAL, "FUSE io_uring payload over 2 MiB");
  if (!io::Engine::current() || !io::Engine::current()->supports_uring_cmd())
    return Status::error(EOPNOTSUPP, "the loop's engine cannot submit io_uring commands");
  // One mapping for every entry, not zeroed: pages are touched only as requests
  // use them. Until every queue has an entry the kernel holds all requests, the
  // mount's first ones included: a mapping per entry (an mmap each, 64 per queue)
  // cost each loop ~8 ms of CPU there (bench/RESULTS.md, issue 33).
  constexpr size_t kEntryBytes = 2 * io::kHugePageSize;
  memory_ = io::AlignedBuffer(cfg_.qids.size() * cfg_.entries_per_queue * kEntryBytes, io::kHugePageSize, false);
  std::byte* next = memory_.data();
  for (uint16_t qid : cfg_.qids) {
    for (unsigned i = 0; i < cfg_.entries_per_queue; ++i) {
      auto e = std::make_unique<Entry>();
      e->ring = this;
      e->qid = qid;
      e->mem = next;
      next += kEntryBytes;
      e->iovs[0] = {e->header(), sizeof(uring_abi::ReqHeader)};
      e->iovs[1] = {e->payload(), cfg_.payload_bytes};
      entries_.push_back(std::move(e));
    }
  }
  in_userspace_.reserve(entries_.size());
  for (auto& e : entries_) submit(*e, uring_abi::kCmdRegister, 0);
  return Status::ok();
}

void FuseRing::submit(Entry& e, uint32_t cmd_op, uint64_t commit_id) {
  e.cmd = {};
  e.cmd.commit_id = commit_id;
  e.cmd.qid = e.qid;
  e.op = io::IoRequest::Op::uring_cmd;
  e.fd = cfg_.fuse_fd;
  e.cmd_op = cmd_op;
  e.buf = &e.cmd;
  e.length = sizeof e.cmd;
  e.iov = e.iovs;
  e.iovcnt = 2;
  e.on_done = &FuseRing::on_entry_done;
  io::Engine::current()->enqueue(&e);
}

void FuseRing::on_entry_done(io::IoRequest* req) {
  auto* e = static_cast<Entry*>(req);
  e->ring->entry_done(*e);
}

void FuseRing::entry_done(Entry& e) {
  const int64_t res = e.result;
  if (res < 0) {
    if (connection_ended(res) || stopping_) return;
    if (!e.registered) {
      fail(Status::from_errno(static_cast<int>(-res), "registering FUSE io_uring queue entries"));
      return;
    }
    // The kernel refused a commit (it no longer knew the request): give it the
    // entry again so its queue keeps its depth.
    log::warn("FUSE io_uring commit failed: {}", Status::from_errno(static_cast<int>(-res), "").to_string());
    e.registered = false;
    submit(e, uring_abi::kCmdRegister, 0);
    return;
  }
  e.registered = true;
  if (!stopping_) deliver(e);
}

void FuseRing::fail(Status st) {
  if (failed_) return;
  failed_ = true;
  if (served_ == 0 && cfg_.on_failure) {
    cfg_.on_failure(std::move(st));
    return;
  }
  log::error("{}", st.to_string());
}

// Turns the entry's buffers into one /dev/fuse-format message ending where the
// payload begins, so the payload itself is not copied.
void FuseRing::deliver(Entry& e) {
  uring_abi::ReqHeader* h = e.header();
  fuse_in_header in;
  std::memcpy(&in, h->in_out, sizeof in);
  const uint64_t payload = h->ring_ent_in_out.payload_sz;
  if (in.len < sizeof in + payload || in.len - sizeof in - payload > uring_abi::kOpInBytes ||
      payload > cfg_.payload_bytes) {
    log::error("malformed FUSE io_uring request: opcode {} length {} payload {}", in.opcode, in.len, payload);
    reply_protocol_error(e, in.unique);
    return;
  }
  const size_t op_bytes = in.len - sizeof in - payload;
  e.huge_on_reply = false;
  if (!e.huge) {
    if (in.opcode == FUSE_READ && op_bytes >= sizeof(fuse_read_in)) {
      fuse_read_in arg;
      std::memcpy(&arg, h->op_in, sizeof arg);
      if (arg.size >= kHugePayloadMin) use_huge_payload(e);  // before the host read fills it
    } else if (in.opcode == FUSE_WRITE && payload >= kHugePayloadMin) {
      e.huge_on_reply = true;  // the payload holds the data until the host write is done
    }
  }
  std::byte* msg = e.payload() - op_bytes - sizeof in;
  std::memcpy(msg, &in, sizeof in);
  std::memcpy(msg + sizeof in, h->op_in, op_bytes);
  in_userspace_.push_back(Held{in.unique, &e});
  ++served_;
  dispatching_ = &e;
  cfg_.dispatch(std::span<std::byte>(msg, in.len));
  dispatching_ = nullptr;
}

// Large payloads on 4 KiB pages cost the kernel one page pin per 4 KiB when it
// copies them, and an O_DIRECT transfer one DMA segment each (a 1 MiB read is
// split in two on a virtio disk of 254 segments). So an entry that carries a
// request of kHugePayloadMin or more gets its payload on a huge page from then
// on: its old pages are dropped (their bytes are not needed: before a READ's
// host read, after a WRITE's reply) and the range advised MADV_HUGEPAGE, so the
// next touch faults in one 2 MiB page. Entries that only ever carry small
// requests keep the few 4 KiB pages they touched; past kMaxHugeEntries per
// ring, entries keep 4 KiB pages whatever they carry.
void FuseRing::use_huge_payload(Entry& e) {
  e.huge = true;  // decided, huge or not: not asked again
  e.huge_on_reply = false;
  if (huge_entries_ >= kMaxHugeEntries) return;
  ++huge_entries_;
  if (::madvise(e.payload(), io::kHugePageSize, MADV_DONTNEED) != 0 ||
      ::madvise(e.payload(), io::kHugePageSize, MADV_HUGEPAGE) != 0)
    log::debug("FUSE io_uring entry stays on 4 KiB pages: {}", Status::from_errno(errno, "madvise").to_string());
}

void FuseRing::reply_protocol_error(Entry& e, uint64_t unique) {
  fuse_out_header out = {};
  out.len = sizeof out;
  out.error = -EIO;
  out.unique = unique;
  std::memcpy(e.header()->in_out, &out, sizeof out);
  e.header()->ring_ent_in_out.payload_sz = 0;
  submit(e, uring_abi::kCmdCommitAndFetch, unique);
}

std::optional<ssize_t> FuseRing::reply(const iovec* iov, int count) {
  if (count < 1 || iov[0].iov_len < sizeof(fuse_out_header)) return std::nullopt;
  fuse_out_header out;
  std::memcpy(&out, iov[0].iov_base, sizeof out);
  auto it = std::find_if(in_userspace_.begin(), in_userspace_.end(),
                         [&out](const Held& h) { return h.unique == out.unique; });
  if (it == in_userspace_.end()) return std::nullopt;
  Entry& e = *it->entry;
  *it = in_userspace_.back();
  in_userspace_.pop_back();
  if (e.huge_on_reply) use_huge_payload(e);  // a WRITE's payload is no longer needed

  // Gather the reply's arguments into the payload buffer; a READ reply built
  // in place (see dispatching_payload()) is already there.
  std::byte* dst = e.payload();
  size_t n = 0;
  size_t total = 0;
  for (int i = 0; i < count; ++i) {
    const auto* src = static_cast<const std::byte*>(iov[i].iov_base);
    size_t len = iov[i].iov_len;
    total += len;
    if (i == 0) {
      src += sizeof out;
      len -= sizeof out;
    }
    if (len == 0) continue;
    if (n + len > cfg_.payload_bytes) {
      out.error = -EIO;
      n = 0;
      break;
    }
    if (src != dst + n) std::memcpy(dst + n, src, len);
    n += len;
  }
  std::memcpy(e.header()->in_out, &out, sizeof out);
  e.header()->ring_ent_in_out.payload_sz = static_cast<uint32_t>(n);
  submit(e, uring_abi::kCmdCommitAndFetch, out.unique);
  return static_cast<ssize_t>(total);
}

std::span<std::byte> FuseRing::dispatching_payload() const {
  if (!dispatching_) return {};
  return std::span<std::byte>(dispatching_->payload(), cfg_.payload_bytes);
}

}  // namespace qcowfs::fuse
