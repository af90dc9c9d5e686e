// Hold: one release still owed, without knowing whose: a range lock's
// holder, a counted entry (an in-flight ticket, a live driver's admission).
// It is a function and the two words it needs, so a hold taken in one layer
// can be handed up through a virtual call and released by the layer that
// finishes the work (image::MappedRead keeps a request's holds until its host
// read is done) with no allocation and no coroutine frame.
//
// Thread-safety: none of its own (one owner); the release function may run on
// any thread, as the thing it releases allows.
#pragma once

#include <cstdint>
#include <utility>

namespace qcowfs::io {

class [[nodiscard]] Hold {
 public:
  using Release = void (*)(void* owner, uint64_t arg);

  Hold() = default;
  Hold(Release fn, void* owner, uint64_t arg) : release_(fn), owner_(owner), arg_(arg) {}
  Hold(Hold&& o) noexcept
      : release_(std::exchange(o.release_, nullptr)), owner_(o.owner_), arg_(o.arg_) {}
  Hold& operator=(Hold&& o) noexcept {
    if (this != &o) {
      release();
      release_ = std::exchange(o.release_, nullptr);
      owner_ = o.owner_;
      arg_ = o.arg_;
    }
    return *this;
  }
  Hold(const Hold&) = delete;
  Hold& operator=(const Hold&) = delete;
  ~Hold() { release(); }

  void release() {
    if (release_ != nullptr) std::exchange(release_, nullptr)(owner_, arg_);
  }
  bool holds() const { return release_ != nullptr; }

 private:
  Release release_ = nullptr;
  void* owner_ = nullptr;
  uint64_t arg_ = 0;
};

}  // namespace qcowfs::io
