// InFlightIo: a grace period for host space that a table entry stopped
// naming. ExtentDriver reads, writes in place and zeroes allocated units
// without a lock: such an I/O looks a unit up in the map, then goes to the
// host. When the unit is unmapped (ExtentWriter::unmap) and its space handed
// to another unit, an I/O that looked the old mapping up before the change
// could still land in (or read from) the other unit's data. So every
// lock-free I/O holds a Ticket from before its first map lookup until its host
// I/O has completed, and space that an entry stopped naming at epoch() e is
// handed out again only once drained(e): every I/O that could have seen the
// old entry has left. As RCU's grace periods: two epochs in use at a time,
// each counting its I/O; a new I/O joins the current epoch, and the epoch
// moves on once the older one is empty, so drained() is true soon after the
// I/O in flight at the change completes, however busy the image stays.
//
// Counters are split over kShards cache lines by thread, so event loops do
// not share one line on every I/O. Nothing is tracked unless the driver asks
// for a Ticket (only writers that unmap: ExtentDriver::unmaps_).
//
// Thread-safety: enter() and Ticket from any thread, lock-free; epoch() and
// drained() by one caller at a time (under ExtentDriver's allocation lock),
// epoch() after the entries changed (their atomic stores).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <utility>

#include "io/hold.h"

namespace qcowfs::image {

class InFlightIo {
 public:
  static constexpr unsigned kShards = 8;

  // One I/O in flight (or none: default-constructed, or after leave()).
  class [[nodiscard]] Ticket {
   public:
    Ticket() = default;
    Ticket(Ticket&& o) noexcept : counter_(std::exchange(o.counter_, nullptr)) {}
    Ticket& operator=(Ticket&& o) noexcept {
      if (this != &o) {
        leave();
        counter_ = std::exchange(o.counter_, nullptr);
      }
      return *this;
    }
    Ticket(const Ticket&) = delete;
    Ticket& operator=(const Ticket&) = delete;
    ~Ticket() { leave(); }
    // The I/O has completed (or will not look at the map again).
    void leave() {
      if (counter_ != nullptr) std::exchange(counter_, nullptr)->fetch_sub(1);
    }
    // The same ticket as an io::Hold (left by its release); this one is left empty.
    io::Hold into_hold() && {
      std::atomic<uint64_t>* counter = std::exchange(counter_, nullptr);
      return counter ? io::Hold(&leave_counter, counter, 0) : io::Hold();
    }

   private:
    friend class InFlightIo;
    explicit Ticket(std::atomic<uint64_t>* counter) : counter_(counter) {}
    static void leave_counter(void* counter, uint64_t) { static_cast<std::atomic<uint64_t>*>(counter)->fetch_sub(1); }
    std::atomic<uint64_t>* counter_ = nullptr;
  };

  // Before the I/O's first map lookup.
  Ticket enter();
  // The current epoch: read after a change of entries, it bounds the epoch of
  // every I/O that saw them before.
  uint64_t epoch() const { return epoch_.load(); }
  // Whether every I/O that entered at or before epoch e has left; moves the
  // epoch on when that helps (the older of the two epochs is empty).
  bool drained(uint64_t e);

 private:
  struct alignas(64) Shard {
    std::array<std::atomic<uint64_t>, 2> count{};  // I/O in flight, by epoch parity
  };
  static unsigned my_shard();
  // I/O in flight in the epochs of parity `slot`, all shards.
  uint64_t in_flight(unsigned slot) const;

  alignas(64) std::atomic<uint64_t> epoch_{0};
  std::array<Shard, kShards> shards_{};
};

}  // namespace qcowfs::image
