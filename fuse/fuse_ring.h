// FuseRing: FUSE over io_uring (Linux 6.14+, fuse.enable_uring=Y) for one
// event loop.
//
// The kernel keeps one request queue per possible CPU ("qid"); a request goes
// to the queue of the CPU its caller runs on. Each queue is served by ring
// entries: a header buffer plus a payload buffer registered with an
// IORING_OP_URING_CMD. The kernel completes that command when it has copied a
// request into the entry; the daemon answers by writing the reply into the
// same buffers and submitting COMMIT_AND_FETCH, which hands the reply to the
// kernel and re-arms the entry in the same SQE. No read() or writev() of
// /dev/fuse per request: requests and replies ride the loop's io_uring_enter
// together with the host I/O. Until every queue has an entry, and always for
// INIT, FORGET, INTERRUPT and notifications, /dev/fuse keeps working as before.
//
// Each entry's buffer is laid out so a request can be handed on (to
// Filesystem::serve_direct() or libfuse) as one contiguous message without
// copying its payload:
//
//   base                            base + 4096 - 40 - op     base + 4096
//   | uring header (288 B) | unused | fuse_in_header | op arg | payload (max_write) |
//
// A WRITE's data therefore starts 4096-aligned (O_DIRECT without a copy), and a
// READ reply can be produced directly in the payload buffer. The payload starts
// on a 2 MiB boundary: an entry that carries a request of kHugePayloadMin bytes
// or more moves its payload to a huge page (see use_huge_payload()).
//
// Thread-safety: a FuseRing belongs to one event-loop thread and is used only
// there (entries are registered on, and complete on, that thread's engine).
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "io/buffer.h"
#include "io/engine.h"
#include "io/status.h"

namespace qcowfs::fuse {

// FUSE-over-io_uring ABI (include/uapi/linux/fuse.h, protocol 7.42), defined
// here because Debian 12's kernel headers predate it.
namespace uring_abi {
constexpr size_t kInOutHeaderBytes = 128;
constexpr size_t kOpInBytes = 128;
constexpr uint32_t kCmdRegister = 1;
constexpr uint32_t kCmdCommitAndFetch = 2;

struct EntInOut {
  uint64_t flags;
  uint64_t commit_id;
  uint32_t payload_sz;
  uint32_t padding;
  uint64_t reserved;
};

struct ReqHeader {
  char in_out[kInOutHeaderBytes];  // fuse_in_header on fetch, fuse_out_header on commit
  char op_in[kOpInBytes];          // the opcode's fixed argument (in_args[0])
  EntInOut ring_ent_in_out;
};

struct CmdReq {
  uint64_t flags;
  uint64_t commit_id;
  uint16_t qid;
  uint8_t padding[6];
};

static_assert(sizeof(EntInOut) == 32);
static_assert(sizeof(ReqHeader) == 288);
static_assert(sizeof(CmdReq) == 24);
}  // namespace uring_abi

// Entries that carry a READ or WRITE of this size or more get a huge-page
// payload, at most kMaxHugeEntries per ring (64 MiB per queue thread): the
// kernel reuses the entry returned last first, so that many serve QD32 of
// large requests.
constexpr size_t kHugePayloadMin = size_t{256} << 10;
constexpr unsigned kMaxHugeEntries = 32;

class FuseRing {
 public:
  // A request the kernel delivered: one contiguous /dev/fuse-format message.
  using Dispatch = std::function<void(std::span<std::byte> message)>;
  // Called once when registration fails before the ring served anything
  // (e.g. EOPNOTSUPP: fuse.enable_uring is off): the caller keeps /dev/fuse.
  using OnFailure = std::function<void(Status)>;

  struct Config {
    int fuse_fd = -1;
    std::vector<uint16_t> qids;   // the kernel queues this ring serves
    unsigned entries_per_queue = 0;
    size_t payload_bytes = 0;     // >= the kernel's max payload (max_write, max_pages)
    Dispatch dispatch;
    OnFailure on_failure;
  };

  explicit FuseRing(Config cfg);
  ~FuseRing();
  FuseRing(const FuseRing&) = delete;
  FuseRing& operator=(const FuseRing&) = delete;

  // Registers every entry on the calling thread's engine.
  Status start();
  // Stops dispatching: requests delivered from now on are left to the kernel,
  // which ends them when the connection goes away.
  void stop() { stopping_ = true; }

  // If the reply (iov[0] is its fuse_out_header) answers a request of this
  // ring, queues it to the kernel and returns the bytes taken; otherwise
  // nullopt (the caller writes it to /dev/fuse).
  std::optional<ssize_t> reply(const iovec* iov, int count);

  // While a request of this ring is being dispatched: its payload buffer, where
  // a READ reply may be built (valid until the reply is queued), else empty.
  std::span<std::byte> dispatching_payload() const;

  // Requests delivered so far (for tests and debug logging).
  uint64_t requests_served() const { return served_; }

 private:
  struct Entry;
  static void on_entry_done(io::IoRequest* req);
  void entry_done(Entry& e);
  void submit(Entry& e, uint32_t cmd_op, uint64_t commit_id);
  void deliver(Entry& e);
  void reply_protocol_error(Entry& e, uint64_t unique);
  void use_huge_payload(Entry& e);
  void fail(Status st);

  Config cfg_;
  io::AlignedBuffer memory_;  // every entry's buffers (see Entry)
  std::vector<std::unique_ptr<Entry>> entries_;
  struct Held {
    uint64_t unique;
    Entry* entry;
  };
  // The requests being served and their entries: at most one per entry, few
  // at a time, searched linearly; no allocation per request.
  std::vector<Held> in_userspace_;
  Entry* dispatching_ = nullptr;
  uint64_t served_ = 0;
  unsigned huge_entries_ = 0;  // entries whose payload was moved to a huge page
  bool stopping_ = false;
  bool failed_ = false;
};

}  // namespace qcowfs::fuse
