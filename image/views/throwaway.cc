// The throwaway overlay (throwaway.h).
#include "image/views/throwaway.h"

#include "image/create.h"
#include "image/format.h"

namespace qcowfs::image {
namespace {

// The overlay's one file, handed to the qcow2 Creator.
class UnnamedFile final : public NewFiles {
 public:
  explicit UnnamedFile(io::HostFile& file) : file_(file) {}
  Result<io::HostFile*> create(const std::string& path) override {
    if (path != file_.path()) return Status::errorf(EINVAL, "{}: the throwaway overlay has one file", path);
    return &file_;
  }

 private:
  io::HostFile& file_;
};

}  // namespace

Task<Result<std::unique_ptr<BlockDriver>>> open_throwaway_overlay(std::unique_ptr<BlockDriver> base,
                                                                  const ImageOptions& opts, const std::string& dir) {
  const uint64_t size = base->size();
  if (size % 512 != 0)
    co_return Status::errorf(EINVAL, "throwaway: the disk's size ({} bytes) is not a multiple of 512 bytes, which a "
                             "qcow2 overlay needs", size);
  const FormatInfo* qcow2 = find_format("qcow2");
  if (!qcow2 || !qcow2->open || !qcow2->prepare_create)
    co_return Status::error(ENOTSUP, "throwaway: qcow2 overlays are not available");
  auto file = io::create_unnamed_file(dir);
  if (!file) co_return file.status().with_context("throwaway overlay");
  const std::string name = (*file)->path();
  CreateRequest request;
  request.path = name;
  request.size = size;
  auto creator = qcow2->prepare_create(request);
  if (!creator) co_return creator.status().with_context("throwaway overlay");
  UnnamedFile files(**file);
  if (Status st = co_await (*creator)->write(files); !st) co_return st.with_context("throwaway overlay");
  ImageOptions o;
  o.format = "qcow2";
  o.file.writable = true;
  o.file.cache = io::CacheMode::unsafe;
  o.file.locking = io::LockMode::off;  // an unnamed file: nobody else can open it
  o.discard_unmap = opts.discard_unmap;
  o.table_cache_size = opts.table_cache_size;
  o.backing = std::make_shared<GivenBacking>(GivenBacking{std::move(base)});
  auto overlay = co_await qcow2->open(std::move(*file), name, std::move(o));
  if (!overlay) co_return overlay.status().with_context("throwaway overlay");
  co_return overlay;
}

}  // namespace qcowfs::image
