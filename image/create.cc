#include "image/create.h"

#include <algorithm>
#include <cctype>
#include <charconv>

namespace qcowfs::image {
namespace {

Status bad_value(std::string_view key, std::string_view value, std::string_view expected) {
  return Status::errorf(EINVAL, "bad value '{}' for option {} (expected {})", value, key, expected);
}

}  // namespace

std::optional<std::string> take_create_option(std::vector<std::pair<std::string, std::string>>& options,
                                              std::string_view key) {
  std::optional<std::string> value;
  std::erase_if(options, [&](const std::pair<std::string, std::string>& o) {
    if (o.first != key) return false;
    value = o.second;
    return true;
  });
  return value;
}

Status no_options_left(const std::vector<std::pair<std::string, std::string>>& options, std::string_view format) {
  if (options.empty()) return Status::ok();
  return Status::errorf(EINVAL, "Invalid parameter '{}' (not an option of the {} format)", options.front().first,
                        format);
}

Status no_backing_file(const CreateRequest& request, std::string_view format) {
  if (!request.backing_file.empty())
    return Status::errorf(EINVAL, "{}: Backing file not supported for file format '{}'", request.path, format);
  if (!request.backing_format.empty())
    return Status::errorf(EINVAL, "Invalid parameter 'backing_fmt' (not an option of the {} format)", format);
  return Status::ok();
}

Result<bool> parse_create_bool(std::string_view key, std::string_view value) {
  if (value == "on" || value == "true" || value == "yes") return true;
  if (value == "off" || value == "false" || value == "no") return false;
  return Status::errorf(EINVAL, "Parameter '{}' expects 'on' or 'off'", key);
}

Task<Status> write_new_image_file(NewFiles& files, const std::string& path, std::span<const std::byte> head,
                                  uint64_t length) {
  auto f = files.create(path);
  if (!f) co_return f.status();
  QCOWFS_CO_TRY(co_await (*f)->write(0, head));
  if (length > head.size()) QCOWFS_CO_TRY(co_await (*f)->truncate(length));
  co_return co_await (*f)->flush();
}

namespace {

class NewImageFileCreator final : public Creator {
 public:
  NewImageFileCreator(std::string path, std::string formatting, uint64_t length,
                      std::function<io::AlignedBuffer()> make_head, size_t head_bytes)
      : path_(std::move(path)),
        formatting_(std::move(formatting)),
        length_(length),
        make_head_(std::move(make_head)),
        head_bytes_(head_bytes) {}

  std::string formatting() const override { return formatting_; }

  Task<Status> write(NewFiles& files) override {
    io::AlignedBuffer head = make_head_();
    std::span<const std::byte> used = head.span();
    if (head_bytes_ != 0) used = used.first(head_bytes_);
    co_return co_await write_new_image_file(files, path_, used, length_);
  }

 private:
  std::string path_;
  std::string formatting_;
  uint64_t length_;
  std::function<io::AlignedBuffer()> make_head_;
  size_t head_bytes_;
};

}  // namespace

std::unique_ptr<Creator> new_image_file_creator(std::string path, std::string formatting, uint64_t length,
                                                std::function<io::AlignedBuffer()> make_head, size_t head_bytes) {
  return std::make_unique<NewImageFileCreator>(std::move(path), std::move(formatting), length, std::move(make_head),
                                               head_bytes);
}

Result<uint64_t> required_size(const CreateRequest& request) {
  if (!request.size) return Status::errorf(EINVAL, "{}: Image creation needs a size parameter", request.path);
  return *request.size;
}

Result<uint64_t> parse_create_size(std::string_view key, std::string_view text) {
  uint64_t n = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), n);
  if (ec != std::errc() || end == text.data()) return bad_value(key, text, "a size such as 64K");
  std::string_view suffix(end, static_cast<size_t>(text.data() + text.size() - end));
  if (suffix == "B" || suffix == "b") suffix = "";
  static constexpr std::string_view kSuffixes = "KMGTPE";
  unsigned shift = 0;
  if (suffix.size() == 1) {
    auto pos = kSuffixes.find(static_cast<char>(std::toupper(static_cast<unsigned char>(suffix[0]))));
    if (pos == std::string_view::npos) return bad_value(key, text, "a size with K, M, G, T, P or E");
    shift = static_cast<unsigned>(10 * (pos + 1));
  } else if (!suffix.empty()) {
    return bad_value(key, text, "a size with K, M, G, T, P or E");
  }
  if (shift >= 64 || n > (~uint64_t{0} >> shift)) return bad_value(key, text, "a smaller size");
  return n << shift;
}

}  // namespace qcowfs::image
