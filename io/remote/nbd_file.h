// NbdFile: the HostFile for an export of an NBD server, named by a URI
// (nbd://host[:port]/export, nbd+unix:///export?socket=PATH), through
// libnbd's asynchronous API. Requests are issued from the event-loop thread
// that makes them (libnbd handles are thread-safe) and driven by one network
// thread that polls the connection (nbd_aio_get_fd/get_direction/notify_*);
// completions resume the waiting coroutine on its own engine (AsyncEvent).
//
// Read-write where the server allows it: writes, flush, trim (discard) and
// write-zeroes map onto the NBD commands; the size is fixed (truncate fails
// with EINVAL, as on a block device). SEEK_DATA/SEEK_HOLE come from the
// server's base:allocation block status when it offers it, else all is data.
// A command unanswered after remote-timeout drops the connection, and so does
// the server closing it: the commands in flight fail with EIO (a log line
// says why), never a hang. The network thread then connects again, with
// back-off (100 ms doubling up to 2 s, each attempt bounded by the timeout);
// meanwhile commands fail with EIO at once. A server that comes back with an
// export of another size is refused (everything keeps failing, logged once).
// Identity, settings and counters are registered for the daemon's statistics
// (io/remote/remote_stats.h) while the file is open.
// Thread-safety: as HostFile: all methods from any event-loop thread.
#pragma once

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "io/fd.h"
#include "io/host_file.h"
#include "io/remote/remote_stats.h"

struct nbd_handle;

namespace qcowfs::io {

// How NbdFile::read() cuts a read of n bytes into commands issued together,
// so that the server reads one piece while it sends another: below 2 x piece,
// commands of up to max_request bytes (one, mostly); else pieces of `piece`
// bytes, larger (4 KiB multiples, at most max_request) where that would make
// more than 16 (what qemu-nbd serves at once per connection). The last piece
// may be shorter.
struct ReadPiece {
  size_t offset, length;
  bool operator==(const ReadPiece&) const = default;
};
std::vector<ReadPiece> split_read(size_t n, size_t piece, size_t max_request);

// Pieces of a large NBD read in flight together (see split_read()).
inline constexpr size_t kNbdReadPiece = 256 * 1024;

class NbdFile final : public HostFile {
 public:
  static Result<std::unique_ptr<NbdFile>> open(const std::string& uri, const OpenOptions& opts);
  ~NbdFile() override;

  Task<Result<size_t>> read(uint64_t off, std::span<std::byte> buf) override;
  Task<Result<size_t>> readv(uint64_t off, std::span<const iovec> iov) override;
  Task<Status> write(uint64_t off, std::span<const std::byte> buf) override;
  Task<Status> writev(uint64_t off, std::span<const iovec> iov) override;
  Task<Status> flush() override;
  Task<Status> discard(uint64_t off, uint64_t len) override;
  Task<Status> write_zeroes(uint64_t off, uint64_t len) override;
  Task<Status> truncate(uint64_t size) override;
  Task<Result<uint64_t>> seek_data(uint64_t off) override;
  Task<Result<uint64_t>> seek_hole(uint64_t off) override;

  uint64_t size() const override { return size_; }
  uint64_t allocated_bytes() const override { return size_; }
  size_t mem_align() const override { return 4096; }
  size_t offset_align() const override { return 1; }
  bool is_block_device() const override { return true; }
  bool writable() const override { return writable_; }
  CacheMode cache_mode() const override { return CacheMode::writeback; }
  const std::string& path() const override { return uri_; }

  // Identity, settings and counters (as remote_stats_snapshot() lists them).
  RemoteStatsSnapshot describe() const;

 private:
  struct Op;
  NbdFile(std::string uri, nbd_handle* h, UniqueFd wake, uint64_t size, bool writable, unsigned timeout_ms);
  void run();
  // Drives the connection for one poll round.
  void serve_connection(nbd_handle* h);
  // Drops the connection when a command has waited past the timeout.
  void check_deadlines(nbd_handle* h);
  // Closes a dead connection (its commands have failed); reconnect() follows.
  void drop_connection(nbd_handle* h);
  // One attempt to connect again (after the back-off delay); true when connected.
  bool reconnect();
  // A new connection to uri_, or nullptr (the reason in *why); bounded by the timeout.
  nbd_handle* connect_once(std::string* why);
  // Waits on the wake fd until the deadline or a wake-up (stop).
  void sleep_until(std::chrono::steady_clock::time_point t);
  void wake();
  // Awaits a command started by submit(cb) (which returns its cookie or -1).
  template <typename Submit>
  Task<Status> command(std::string_view what, uint64_t off, Submit submit);
  template <typename Submit>
  Task<Status> command_with(std::string_view what, uint64_t off, Op& op, Submit submit);
  Task<Result<uint64_t>> seek(uint64_t off, bool want_data);
  // One NBD read command of buf.size() bytes at off.
  Task<Status> read_piece(uint64_t off, std::span<std::byte> buf);
  Status error(std::string_view what, uint64_t off, int err) const;

  const std::string uri_;
  UniqueFd wake_;  // eventfd: a command was queued, or stop
  const uint64_t size_;
  const bool writable_;
  bool can_flush_ = false, can_trim_ = false, can_zero_ = false, can_status_ = false;
  const std::chrono::milliseconds timeout_;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> timed_out_{false};  // the current connection was dropped for a timeout
  mutable std::mutex mu_;  // guards h_, connected_, in_flight_ and next_id_
  nbd_handle* h_;          // replaced by the network thread when it reconnects
  bool connected_ = true;
  std::map<uint64_t, std::chrono::steady_clock::time_point> in_flight_;  // id -> when issued
  uint64_t next_id_ = 0;
  // Network thread only.
  std::chrono::milliseconds backoff_{0};
  std::chrono::steady_clock::time_point next_attempt_;
  bool reconnect_failure_logged_ = false;
  RemoteCounters counters_;
  std::thread thread_;
  std::optional<RemoteStatsRegistration> registration_;  // reset first in the destructor
};

}  // namespace qcowfs::io
