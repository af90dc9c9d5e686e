#include "image/raw/raw.h"

#include <fmt/format.h>

#include <algorithm>

namespace qcowfs::image {
namespace {

class RawCreator final : public Creator {
 public:
  RawCreator(std::string path, uint64_t size, bool allocate)
      : path_(std::move(path)), size_(size), allocate_(allocate) {}

  std::string formatting() const override { return fmt::format("fmt=raw size={}", size_); }

  Task<Status> write(NewFiles& files) override {
    auto f = files.create(path_);
    if (!f) co_return f.status();
    co_return co_await create_raw(**f, size_, allocate_);
  }

 private:
  std::string path_;
  uint64_t size_;
  bool allocate_;
};

bool is_encrypt_option(const std::pair<std::string, std::string>& o) {
  return o.first == "encryption" || o.first.starts_with("encrypt.");
}

// preallocation=: falloc and full give every byte host space; off and
// metadata (nothing to preallocate in a raw image) leave it sparse.
Result<bool> take_preallocation(std::vector<std::pair<std::string, std::string>>& options) {
  const auto v = take_create_option(options, "preallocation");
  if (!v || *v == "off" || *v == "metadata") return false;
  if (*v == "falloc" || *v == "full") return true;
  return Status::errorf(EINVAL, "bad value '{}' for option preallocation (expected off, metadata, falloc or full)",
                        *v);
}

}  // namespace

Result<std::unique_ptr<Creator>> prepare_raw_create(const CreateRequest& request) {
  QCOWFS_TRY(no_backing_file(request, "raw"));
  auto options = request.options;
  if (std::any_of(options.begin(), options.end(), is_encrypt_option))
    return Status::error(EINVAL, "a raw image cannot be encrypted (use -f luks)");
  auto allocate = take_preallocation(options);
  if (!allocate) return allocate.status();
  QCOWFS_TRY(no_options_left(options, "raw"));
  auto size = required_size(request);
  if (!size) return size.status();
  return std::unique_ptr<Creator>(std::make_unique<RawCreator>(request.path, *size, *allocate));
}

}  // namespace qcowfs::image
