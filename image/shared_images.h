// SharedImages: read-only images opened once and shared by every user, so
// that overlays naming one backing file use one opened image of it (one file
// descriptor and lock, one metadata cache, one data cache) however many of
// them are open. A catalogue mount (fuse/catalogue.h) gives every image it
// opens the same SharedImages through ImageOptions::shared_backing, and
// open_backing_file() (image/backing.h) then opens backing files here.
//
// Images are told apart by the host file's identity (st_dev, st_ino: the same
// file under two names is one image) and by how they are opened (format, cache
// mode, key source, table cache size, locking): users that open one file
// differently get their own image. The registry holds its images weakly: an
// image is closed when the last driver handed out for it is destroyed (a
// read-only driver needs no close()).
//
// Thread-safety: open() may be called concurrently from any event-loop thread
// (one mutex guards the table; it is never held across a co_await). Two users
// that open the same image at the same moment may both open it; the second to
// finish drops its copy and joins the first. The drivers handed out are
// thread-safe like every BlockDriver.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>

#include "image/block_driver.h"
#include "io/host_file.h"

namespace qcowfs::image {

class SharedImages {
 public:
  // Opens path read-only (opts.file.writable is ignored), or joins the image
  // already opened for the same file with the same options. The driver
  // returned is a handle: destroying it leaves the image.
  Task<Result<std::unique_ptr<BlockDriver>>> open(std::string path, ImageOptions opts);

  // How many distinct images are open now (for tests and benchmarks).
  size_t open_count() const;

 private:
  using Key = std::tuple<io::FileIdentity, std::string, int, const void*, uint64_t, int, bool>;
  std::shared_ptr<BlockDriver> find(const Key& key);
  std::shared_ptr<BlockDriver> insert_or_join(const Key& key, std::shared_ptr<BlockDriver> opened);

  mutable std::mutex mu_;
  std::map<Key, std::weak_ptr<BlockDriver>> images_;  // guarded by mu_
};

}  // namespace qcowfs::image
