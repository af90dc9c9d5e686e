// `qcowfs create -f qcow2` through the registry (image/qcow2/qcow2_create.h):
// the request's options applied in order, validated, then the image (and its
// external data file) written by write_new_image. An encrypted image's LUKS
// header is made through image/crypto/ once the files are locked.
#include <fmt/format.h>

#include "image/crypto/luks_new.h"
#include "image/path.h"
#include "image/qcow2/qcow2_create.h"

namespace qcowfs::image::qcow2 {
namespace {

class Qcow2Creator final : public Creator {
 public:
  Qcow2Creator(std::string path, CreateOptions options) : path_(std::move(path)), o_(std::move(options)) {
    if (!o_.data_file.empty()) data_path_ = resolve_relative(path_, o_.data_file);
  }

  std::string formatting() const override {
    std::string s = "fmt=qcow2";
    if (o_.encrypt) s += " encrypt.format=luks" + luks_formatting(o_.luks, "encrypt.");
    s += fmt::format(" cluster_size={} extended_l2={} compression_type={} size={}", o_.cluster_size,
                     o_.extended_l2 ? "on" : "off", o_.compression_type ? "zstd" : "zlib", o_.size);
    if (!o_.backing_file.empty()) s += fmt::format(" backing_file={}", o_.backing_file);
    if (!o_.backing_format.empty()) s += fmt::format(" backing_fmt={}", o_.backing_format);
    if (!o_.data_file.empty())
      s += fmt::format(" data_file={} data_file_raw={}", o_.data_file, o_.data_file_raw ? "on" : "off");
    s += fmt::format(" lazy_refcounts={} refcount_bits={}", o_.lazy_refcounts ? "on" : "off", o_.refcount_bits);
    if (o_.preallocation != Preallocation::off) s += fmt::format(" preallocation={}", to_string(o_.preallocation));
    return s;
  }

  std::vector<std::string> extra_paths() const override {
    if (data_path_.empty()) return {};
    return {data_path_};
  }

  Status ask_secrets() override {
    if (!o_.encrypt) return Status::ok();
    auto formatted = format_new_luks(o_.luks, path_, "encrypt.key-file");
    if (!formatted) return formatted.status();
    luks_ = std::move(*formatted);
    return Status::ok();
  }

  // The data file first (as it is locked first), then the image.
  Task<Status> write(NewFiles& files) override {
    io::HostFile* data = nullptr;
    if (!data_path_.empty()) {
      auto d = files.create(data_path_);
      if (!d) co_return d.status();
      data = *d;
    }
    auto f = files.create(path_);
    if (!f) co_return f.status();
    co_return co_await write_new_image(**f, data, o_, luks_.header);
  }

 private:
  std::string path_;
  CreateOptions o_;
  std::string data_path_;  // o_.data_file resolved against the image's directory
  crypto::LuksFormatted luks_;
};

}  // namespace

Result<std::unique_ptr<Creator>> prepare_qcow2_create(const CreateRequest& request) {
  CreateOptions o;
  for (const auto& [key, value] : request.options) QCOWFS_TRY(apply_create_option(o, key, value));
  if (request.size) {
    o.size = *request.size;
    o.size_given = true;
  }
  o.backing_file = request.backing_file;
  o.backing_format = request.backing_format;
  auto valid = validate_create_options(std::move(o));
  if (!valid) return valid.status();
  return std::unique_ptr<Creator>(std::make_unique<Qcow2Creator>(request.path, std::move(*valid)));
}

}  // namespace qcowfs::image::qcow2
