#include "image/shared_images.h"

#include <utility>

#include "image/forwarding_driver.h"

namespace qcowfs::image {
namespace {

// A user's handle on a shared read-only image: every call goes to the image;
// close() only leaves it (the image is read-only: nothing to write back), and
// the image is destroyed with its last handle.
class SharedImageHandle final : public ForwardingDriver {
 public:
  explicit SharedImageHandle(std::shared_ptr<BlockDriver> image) : ForwardingDriver(std::move(image)) {}

  bool read_only() const override { return true; }
  Task<Status> close() override { co_return Status::ok(); }
  Task<Status> idle_writeback() override { co_return Status::ok(); }
  std::optional<MappedRead> map_read(uint64_t off, uint64_t len) override {  // the bytes are the image's
    return inner().map_read(off, len);
  }
};

}  // namespace

std::shared_ptr<BlockDriver> SharedImages::find(const Key& key) {
  std::lock_guard lk(mu_);
  auto it = images_.find(key);
  if (it == images_.end()) return nullptr;
  auto image = it->second.lock();
  if (!image) images_.erase(it);
  return image;
}

std::shared_ptr<BlockDriver> SharedImages::insert_or_join(const Key& key, std::shared_ptr<BlockDriver> opened) {
  std::lock_guard lk(mu_);
  std::weak_ptr<BlockDriver>& slot = images_[key];
  if (auto first = slot.lock()) return first;  // opened meanwhile by another user: ours is dropped
  slot = opened;
  return opened;
}

size_t SharedImages::open_count() const {
  std::lock_guard lk(mu_);
  size_t n = 0;
  for (const auto& [key, image] : images_) n += image.expired() ? 0 : 1;
  return n;
}

Task<Result<std::unique_ptr<BlockDriver>>> SharedImages::open(std::string path, ImageOptions opts) {
  opts.file.writable = false;
  auto file = io::open_host_file(path, opts.file);
  if (!file) co_return file.status();
  std::optional<io::FileIdentity> id = io::file_identity(**file);
  if (!id) co_return co_await open_image_file(std::move(*file), std::move(path), std::move(opts));  // not shareable
  const Key key{*id,
                opts.format,
                static_cast<int>(opts.file.cache_mode()),
                opts.keys.get(),
                opts.table_cache_size,
                static_cast<int>(opts.file.locking),
                opts.file.force_share};
  if (auto image = find(key)) co_return std::make_unique<SharedImageHandle>(std::move(image));
  auto opened = co_await open_image_file(std::move(*file), std::move(path), std::move(opts));
  if (!opened) co_return opened.status();
  std::shared_ptr<BlockDriver> image = insert_or_join(key, std::shared_ptr<BlockDriver>(std::move(*opened)));
  co_return std::make_unique<SharedImageHandle>(std::move(image));
}

}  // namespace qcowfs::image
