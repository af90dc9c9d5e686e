// `qcowfs create -f luks` (image/luks/luks.h): qemu-img's LUKS options by
// their unprefixed names; the passphrase is asked once the image is locked.
#include <fmt/format.h>

#include "image/crypto/luks_new.h"
#include "image/luks/luks.h"

namespace qcowfs::image {
namespace {

class LuksCreator final : public Creator {
 public:
  LuksCreator(std::string path, uint64_t size, LuksCreateOptions options)
      : path_(std::move(path)), size_(size), options_(std::move(options)) {}

  std::string formatting() const override {
    return fmt::format("fmt=luks size={}{}", size_, luks_formatting(options_, ""));
  }

  Status ask_secrets() override {
    auto formatted = format_new_luks(options_, path_, "key-file");
    if (!formatted) return formatted.status();
    header_ = std::move(*formatted);
    return Status::ok();
  }

  Task<Status> write(NewFiles& files) override {
    if (header_.header.empty()) co_return Status::error(EINVAL, "a LUKS image needs its header (ask_secrets)");
    auto f = files.create(path_);
    if (!f) co_return f.status();
    co_return co_await create_luks(**f, header_, size_);
  }

 private:
  std::string path_;
  uint64_t size_;
  LuksCreateOptions options_;
  crypto::LuksFormatted header_;
};

}  // namespace

Result<std::unique_ptr<Creator>> prepare_luks_create(const CreateRequest& request) {
  QCOWFS_TRY(no_backing_file(request, "luks"));
  LuksCreateOptions options;
  for (const auto& [key, value] : request.options) QCOWFS_TRY(apply_luks_create_option(options, key, value));
  auto size = required_size(request);
  if (!size) return size.status();
  QCOWFS_TRY(luks_format_params(options).status());  // a bad cipher is refused before the file is locked
  return std::unique_ptr<Creator>(std::make_unique<LuksCreator>(request.path, *size, std::move(options)));
}

}  // namespace qcowfs::image
