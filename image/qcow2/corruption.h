// Corruption: the one corruption state of a writable qcow2 image (as QEMU's
// qcow2_signal_corruption). Three states, moving only forward:
//
//   none   -> found    corrupt metadata was found by a request (found()); that
//                      request fails with EIO, the first message is kept
//   found  -> marked   mark() set the corrupt bit (incompatible feature bit 1)
//   none   -> marked   in the header, in memory and then on disk (one write +
//                      flush); every later write, discard, zeroing and resize
//                      fails with EIO (refuse_writes()) while reads go on
//
// mark() is the only code that sets the corrupt bit. It runs once: the first
// caller writes the bit, later callers return at once. The in-memory header
// carries the bit from that moment even when the write fails (the failure is
// logged), so any later header write keeps it.
//
// Thread-safety: found(), marked() and refuse_writes() may be called from any
// thread (the state is atomic; the first message is guarded by a mutex).
// mark() writes the header without the writer's metadata lock, as the header
// bytes it writes change nowhere else once the image is corrupt.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>

#include "image/qcow2/header.h"
#include "io/host_file.h"
#include "io/status.h"
#include "io/task.h"

namespace qcowfs::image::qcow2 {

class Corruption {
 public:
  enum class State : uint8_t { none, found, marked };

  // Records corrupt metadata `what` found in `path`: logs it, keeps the first
  // message and returns the EIO Status for the request that found it.
  Status found(const std::string& path, std::string what);
  // Marks the image corrupt (see above). Returns whether this call did it.
  Task<bool> mark(io::HostFile& file, Header& header, const std::string& path);
  // found() and mark() in one step, for corruption found outside a request's
  // own error path (metadata layout at open, a data write landing on metadata).
  Task<Status> signal(io::HostFile& file, Header& header, const std::string& path, std::string what);

  State state() const { return state_.load(std::memory_order_acquire); }
  bool seen() const { return state() != State::none; }
  bool marked() const { return state() == State::marked; }
  // EIO when the image is marked corrupt, else ok.
  Status refuse_writes() const;
  std::string first_message() const;

 private:
  std::atomic<State> state_{State::none};
  mutable std::mutex mu_;  // guards first_
  std::string first_;
};

}  // namespace qcowfs::image::qcow2
