#include "fuse/live_driver.h"

#include <thread>

#include "image/forwarding_driver.h"
#include "io/buffer.h"

namespace qcowfs::fuse {

// Counts one admitted call out when the call is done.
class LiveDriver::Admission {
 public:
  explicit Admission(LiveDriver& d) : d_(d) {}
  Admission(const Admission&) = delete;
  Admission& operator=(const Admission&) = delete;
  ~Admission() { d_.leave(); }

 private:
  LiveDriver& d_;
};

// Counts one synchronous getter in for its duration; the driver it reads is
// not destroyed meanwhile (replace() waits for getters_ to reach zero).
class LiveDriver::Getter {
 public:
  explicit Getter(const LiveDriver& d) : d_(d) { d_.getters_.fetch_add(1); }
  Getter(const Getter&) = delete;
  Getter& operator=(const Getter&) = delete;
  ~Getter() { d_.getters_.fetch_sub(1); }
  // seq_cst after the count: see replace().
  image::BlockDriver* driver() const { return d_.current_.load(); }

 private:
  const LiveDriver& d_;
};

namespace {

// A snapshot view opened through the LiveDriver: it borrows the driver it came
// from (BlockDriver::open_snapshot()), so it holds that driver until it goes.
class LiveSnapshotView final : public image::ForwardingDriver {
 public:
  LiveSnapshotView(std::unique_ptr<image::BlockDriver> view, std::shared_ptr<image::BlockDriver> parent)
      : ForwardingDriver(std::move(view)), parent_(std::move(parent)) {}
  ~LiveSnapshotView() override { drop_inner(); }  // the view before its parent
  std::optional<image::MappedRead> map_read(uint64_t off, uint64_t len) override {  // the bytes are the image's
    return inner().map_read(off, len);
  }

 private:
  std::shared_ptr<image::BlockDriver> parent_;
};

}  // namespace

struct LiveDriver::EnterAwaiter {
  LiveDriver& d;
  bool await_ready() const noexcept {
    d.admitted_.fetch_add(1);
    if (!d.paused_.load()) return true;  // the common case: no lock
    d.leave();                           // paused: back out, then queue
    return false;
  }
  bool await_suspend(std::coroutine_handle<> h) {
    std::lock_guard lk(d.mu_);
    if (!d.paused_.load()) {  // resumed meanwhile
      d.admitted_.fetch_add(1);
      return false;
    }
    d.queued_.push_back(io::Waiter{h, io::Engine::current()});  // counted in by resume()
    return true;
  }
  void await_resume() const noexcept {}
};

struct LiveDriver::DrainAwaiter {
  LiveDriver& d;
  bool await_ready() const noexcept { return false; }
  bool await_suspend(std::coroutine_handle<> h) {
    std::lock_guard lk(d.mu_);
    d.paused_.store(true);
    if (d.admitted_.load() == 0) return false;
    d.drainer_ = io::Waiter{h, io::Engine::current()};
    return true;
  }
  void await_resume() const noexcept {}
};

LiveDriver::LiveDriver(std::unique_ptr<image::BlockDriver> driver) : owner_(std::move(driver)) {
  current_.store(owner_.get(), std::memory_order_release);
}

LiveDriver::EnterAwaiter LiveDriver::enter() { return EnterAwaiter{*this}; }

void LiveDriver::leave() {
  if (admitted_.fetch_sub(1) != 1 || !paused_.load()) return;
  std::optional<io::Waiter> drainer;
  {
    std::lock_guard lk(mu_);
    if (admitted_.load() == 0 && drainer_) drainer = std::exchange(drainer_, std::nullopt);
  }
  if (drainer) drainer->wake();
}

Task<void> LiveDriver::pause() { co_await DrainAwaiter{*this}; }

void LiveDriver::resume() {
  std::vector<io::Waiter> queued;
  {
    std::lock_guard lk(mu_);
    admitted_.fetch_add(queued_.size());
    paused_.store(false);
    queued.swap(queued_);
  }
  for (const io::Waiter& w : queued) w.wake();
}

// Paused: no admitted call holds the old driver. A getter that read the old
// pointer counted itself in before (both seq_cst), so once the swap is
// stored and getters_ is seen at zero, none can still be using it.
void LiveDriver::replace(std::unique_ptr<image::BlockDriver> driver, Status why) {
  broken_ = driver ? Status::ok() : (why.is_ok() ? Status::error(EIO, "the image could not be reopened") : why);
  std::shared_ptr<image::BlockDriver> old = std::exchange(owner_, std::move(driver));
  current_.store(owner_.get());
  while (getters_.load() != 0) std::this_thread::yield();  // getters never block: a short wait
  old.reset();  // destroyed here unless a snapshot view opened from it holds it
}

Result<image::BlockDriver*> LiveDriver::admitted_driver() const {
  image::BlockDriver* d = current();
  if (!d) return Status::error(EIO, broken_.message());
  return d;
}

std::string_view LiveDriver::format_name() const {
  Getter g(*this);
  auto* d = g.driver();
  return d ? d->format_name() : "none";
}
uint64_t LiveDriver::size() const {
  Getter g(*this);
  auto* d = g.driver();
  return d ? d->size() : 0;
}
bool LiveDriver::read_only() const {
  Getter g(*this);
  auto* d = g.driver();
  return d ? d->read_only() : true;
}
size_t LiveDriver::mem_align() const {
  Getter g(*this);
  auto* d = g.driver();
  return d ? d->mem_align() : io::kMinMemAlign;
}
uint64_t LiveDriver::allocated_bytes() const {
  Getter g(*this);
  auto* d = g.driver();
  return d ? d->allocated_bytes() : 0;
}
io::HostFile* LiveDriver::identity_file() {
  Getter g(*this);
  auto* d = g.driver();
  return d ? d->identity_file() : nullptr;
}
image::ImageDetails LiveDriver::details() const {
  Getter g(*this);
  auto* d = g.driver();
  return d ? d->details() : image::ImageDetails{};
}
std::vector<image::SnapshotInfo> LiveDriver::snapshots() const {
  Getter g(*this);
  auto* d = g.driver();
  return d ? d->snapshots() : std::vector<image::SnapshotInfo>{};
}
std::vector<image::BitmapInfo> LiveDriver::dirty_bitmaps() const {
  Getter g(*this);
  auto* d = g.driver();
  return d ? d->dirty_bitmaps() : std::vector<image::BitmapInfo>{};
}
// Synchronous, as the getters: the current driver's live bits (a run asked
// during a swap reads the closed driver's last bits, never freed memory).
Result<image::BitmapRun> LiveDriver::bitmap_run(std::string_view name, uint64_t off, uint64_t len) const {
  Getter g(*this);
  auto* d = g.driver();
  if (!d) return Status::error(EIO, "the image could not be reopened after a live snapshot");
  return d->bitmap_run(name, off, len);
}

// Each call: admitted through the gate, then run on the current driver.
#define QCOWFS_LIVE_CALL(call)                  \
  co_await enter();                             \
  Admission admission(*this);                   \
  auto d = admitted_driver();                   \
  if (!d) co_return d.status();                 \
  co_return co_await (*d)->call

Task<Status> LiveDriver::read(uint64_t off, std::span<std::byte> buf) { QCOWFS_LIVE_CALL(read(off, buf)); }
// Admitted as a call (EnterAwaiter) without waiting: paused, nullopt.
std::optional<image::MappedRead> LiveDriver::map_read(uint64_t off, uint64_t len) {
  admitted_.fetch_add(1);
  image::BlockDriver* d = paused_.load() ? nullptr : current();
  std::optional<image::MappedRead> run = d ? d->map_read(off, len) : std::nullopt;
  if (run && !run->full()) {
    run->keep(io::Hold(&LiveDriver::leave_held, this, 0));
  } else {
    run.reset();  // the inner driver's holds before our count
    leave();
  }
  return run;
}

Task<Status> LiveDriver::write(uint64_t off, std::span<const std::byte> buf) { QCOWFS_LIVE_CALL(write(off, buf)); }
Task<Status> LiveDriver::flush() { QCOWFS_LIVE_CALL(flush()); }
Task<Status> LiveDriver::discard(uint64_t off, uint64_t len) { QCOWFS_LIVE_CALL(discard(off, len)); }
Task<Status> LiveDriver::write_zeroes(uint64_t off, uint64_t len, bool may_unmap) {
  QCOWFS_LIVE_CALL(write_zeroes(off, len, may_unmap));
}
Task<Status> LiveDriver::truncate(uint64_t new_size) { QCOWFS_LIVE_CALL(truncate(new_size)); }
Task<Result<image::BlockStatus>> LiveDriver::block_status(uint64_t off, uint64_t len) {
  QCOWFS_LIVE_CALL(block_status(off, len));
}
Task<Status> LiveDriver::idle_writeback() { QCOWFS_LIVE_CALL(idle_writeback()); }
#undef QCOWFS_LIVE_CALL

// Admitted, so owner_ does not change under us; the view holds its parent.
Task<Result<std::unique_ptr<image::BlockDriver>>> LiveDriver::open_snapshot(std::string id_or_name) {
  co_await enter();
  Admission admission(*this);
  std::shared_ptr<image::BlockDriver> parent = owner_;
  if (!parent) co_return Status::error(EIO, broken_.message());
  auto view = co_await parent->open_snapshot(std::move(id_or_name));
  if (!view) co_return view.status();
  co_return std::unique_ptr<image::BlockDriver>(std::make_unique<LiveSnapshotView>(std::move(*view), std::move(parent)));
}

// The last call: a driver that could not be reopened has nothing to close.
Task<Status> LiveDriver::close() {
  co_await enter();
  Admission admission(*this);
  image::BlockDriver* d = current();
  if (!d) co_return Status::ok();
  co_return co_await d->close();
}

}  // namespace qcowfs::fuse
