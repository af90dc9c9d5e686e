// InFlightIo (in_flight.h). Every atomic operation here is sequentially
// consistent: an I/O counted in its epoch's slot before it read the epoch is
// seen by any drained() that reads the counters after the epoch moved past it.
#include "image/extent/in_flight.h"

namespace qcowfs::image {

unsigned InFlightIo::my_shard() {
  static std::atomic<unsigned> next{0};
  thread_local const unsigned shard = next.fetch_add(1, std::memory_order_relaxed) % kShards;
  return shard;
}

// Counted in the slot of the epoch it read, re-read after counting: if the
// epoch moved meanwhile, a drained() may have found that slot empty without
// it, so it counts again in the new one.
InFlightIo::Ticket InFlightIo::enter() {
  Shard& shard = shards_[my_shard()];
  for (;;) {
    const uint64_t e = epoch_.load();
    std::atomic<uint64_t>& count = shard.count[e & 1];
    count.fetch_add(1);
    if (epoch_.load() == e) return Ticket(&count);
    count.fetch_sub(1);
  }
}

uint64_t InFlightIo::in_flight(unsigned slot) const {
  uint64_t n = 0;
  for (const Shard& s : shards_) n += s.count[slot].load();
  return n;
}

// Epoch now + 1 may begin when epoch now - 1 (the same slot) is empty. Once
// the epoch is e + 1 nothing new joins epoch e, so its slot only drains; at
// e + 2 it was empty when the epoch moved.
bool InFlightIo::drained(uint64_t e) {
  for (;;) {
    const uint64_t now = epoch_.load();
    if (now > e + 1) return true;
    if (now == e + 1) return in_flight(e & 1) == 0;
    if (in_flight((now + 1) & 1) != 0) return false;
    epoch_.store(now + 1);
  }
}

}  // namespace qcowfs::image
