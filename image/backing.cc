#include "image/backing.h"

#include <limits.h>
#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "image/path.h"
#include "image/shared_images.h"
#include "io/engine.h"
#include "io/log.h"
#include "io/remote/remote_options.h"
#include "io/sync.h"

namespace qcowfs::image {
namespace {

std::string real_path(const std::string& path) {
  char buf[PATH_MAX];
  if (::realpath(path.c_str(), buf) == nullptr) return path;
  return buf;
}

// The stand-in for a remote backing file that could not be opened with its
// overlay (open_backing_file, defer_remote_backing). Requests before it opens
// try to open it (one at a time, at most every kDeferredRetry); once open,
// every request goes to the opened driver.
// State: closed -> open (ready_ set once, under open_mu_, never reset).
class DeferredBacking final : public BlockDriver {
 public:
  DeferredBacking(std::string path, ImageOptions opts, Status first_failure)
      : path_(std::move(path)), opts_(std::move(opts)), failure_(std::move(first_failure)),
        next_try_(std::chrono::steady_clock::now() + kDeferredRetry) {}

  std::string_view format_name() const override {
    if (BlockDriver* d = ready()) return d->format_name();
    return opts_.format.empty() ? std::string_view("unknown") : std::string_view(opts_.format);
  }
  // Unknown until opened: larger than any overlay, so that the overlay asks.
  uint64_t size() const override {
    BlockDriver* d = ready();
    return d ? d->size() : static_cast<uint64_t>(INT64_MAX);
  }
  bool read_only() const override { return true; }
  size_t mem_align() const override {
    BlockDriver* d = ready();
    return d ? d->mem_align() : 4096;
  }
  uint64_t allocated_bytes() const override {
    BlockDriver* d = ready();
    return d ? d->allocated_bytes() : 0;
  }
  ImageDetails details() const override {
    BlockDriver* d = ready();
    return d ? d->details() : ImageDetails{};
  }

  Task<Status> read(uint64_t off, std::span<std::byte> buf) override {
    auto d = co_await opened();
    if (!d) co_return d.status();
    co_return co_await read_backing_range(**d, off, buf);
  }
  Task<Result<BlockStatus>> block_status(uint64_t off, uint64_t len) override {
    auto d = co_await opened();
    if (!d) co_return d.status();
    const uint64_t real = (*d)->size();
    if (off < real) co_return co_await (*d)->block_status(off, std::min(len, real - off));
    BlockStatus past_end;  // zeros no layer records, as an overlay past its backing's end
    past_end.length = len;
    past_end.zero = true;
    co_return past_end;
  }
  Task<Status> write(uint64_t, std::span<const std::byte>) override { co_return read_only_error(); }
  Task<Status> discard(uint64_t, uint64_t) override { co_return read_only_error(); }
  Task<Status> write_zeroes(uint64_t, uint64_t, bool) override { co_return read_only_error(); }
  Task<Status> truncate(uint64_t) override { co_return read_only_error(); }
  Task<Status> flush() override {
    BlockDriver* d = ready();
    if (!d) co_return Status::ok();
    co_return co_await d->flush();
  }
  Task<Status> close() override {
    BlockDriver* d = ready();
    if (!d) co_return Status::ok();
    co_return co_await d->close();
  }

 private:
  BlockDriver* ready() const { return ready_.load(std::memory_order_acquire); }
  Status read_only_error() const { return Status::errorf(EROFS, "backing file {} is read-only", path_); }
  Task<Result<BlockDriver*>> opened();

  const std::string path_;
  const ImageOptions opts_;
  std::atomic<BlockDriver*> ready_{nullptr};
  io::AsyncMutex open_mu_;  // guards the members below; held while opening
  std::unique_ptr<BlockDriver> inner_;
  Status failure_;
  std::chrono::steady_clock::time_point next_try_;
};

Task<Result<BlockDriver*>> DeferredBacking::opened() {
  if (BlockDriver* d = ready()) co_return d;
  auto guard = co_await open_mu_.lock();
  if (BlockDriver* d = ready()) co_return d;
  const auto now = std::chrono::steady_clock::now();
  if (now >= next_try_) {
    // HostFile opens of URLs block for their first request: on a worker thread.
    Result<std::unique_ptr<io::HostFile>> file = Status::error(EIO, "not opened");
    (void)co_await io::offload([&] {
      file = io::open_host_file(path_, opts_.file);
      return int64_t{0};
    });
    if (file) {
      auto d = co_await open_image_file(std::move(*file), path_, opts_);
      if (d) {
        inner_ = std::move(*d);
        ready_.store(inner_.get(), std::memory_order_release);
        log::info("backing file {} of {} is reachable now and open", path_, opts_.backing_of);
        co_return inner_.get();
      }
      failure_ = d.status();
    } else {
      failure_ = file.status();
    }
    next_try_ = std::chrono::steady_clock::now() + kDeferredRetry;
  }
  co_return Status::errorf(EIO, "backing file {} of {} is unreachable: {}", path_, opts_.backing_of,
                           failure_.message());
}

}  // namespace

Result<std::string> enter_backing_chain(const std::string& path, const ImageOptions& opts) {
  std::string self_real = real_path(path);
  if (std::find(opts.backing_chain.begin(), opts.backing_chain.end(), self_real) != opts.backing_chain.end())
    return Status::errorf(ELOOP, "backing chain loop: {} is its own backing file", self_real);
  return self_real;
}

Task<Result<std::unique_ptr<BlockDriver>>> open_backing_file(const std::string& overlay_path,
                                                            const std::string& name, const std::string& format,
                                                            const ImageOptions& overlay_opts, bool may_defer) {
  std::string bpath = resolve_relative(overlay_path, name);
  ImageOptions b;
  b.format = format;
  b.file = overlay_opts.file;
  b.file.writable = false;
  b.table_cache_size = overlay_opts.table_cache_size;
  b.keys = overlay_opts.keys;  // one passphrase for the chain
  b.backing_chain = overlay_opts.backing_chain;
  b.backing_chain.push_back(real_path(overlay_path));
  b.backing_of = overlay_path;
  // Shared with every other overlay of the same file (and so is its own backing file).
  std::shared_ptr<SharedImages> shared = overlay_opts.shared_backing;
  b.shared_backing = shared;
  b.defer_remote_backing = overlay_opts.defer_remote_backing;
  Result<std::unique_ptr<BlockDriver>> d = Status::error(EINVAL, "unopened");
  if (shared) d = co_await shared->open(bpath, b);
  else d = co_await open_image(bpath, b);
  if (d) co_return d;
  const std::string context = fmt::format("opening backing file '{}' of {}", bpath, overlay_path);
  if (!may_defer || !overlay_opts.defer_remote_backing || !io::is_remote_location(bpath))
    co_return d.status().with_context(context);
  log::warn("{}: {}; reads of what {} does not hold fail with EIO until it opens", context, d.status().message(),
            overlay_path);
  co_return std::unique_ptr<BlockDriver>(std::make_unique<DeferredBacking>(bpath, std::move(b), d.status()));
}

Task<Status> read_backing_range(BlockDriver& backing, uint64_t guest, std::span<std::byte> dst) {
  const uint64_t bsize = backing.size();
  const uint64_t n = guest < bsize ? std::min<uint64_t>(dst.size(), bsize - guest) : 0;
  if (n < dst.size()) std::memset(dst.data() + n, 0, dst.size() - n);
  if (n == 0) co_return Status::ok();
  co_return co_await backing.read(guest, dst.first(n));
}

}  // namespace qcowfs::image
