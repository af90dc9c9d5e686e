#include "io/remote/remote_options.h"

#include <cctype>
#include <charconv>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace qcowfs::io {
namespace {

Status bad_remote_value(std::string_view key, std::string_view value, std::string_view expected) {
  return Status::errorf(EINVAL, "bad value '{}' for option {} (expected {})", value, key, expected);
}

// "256K", "1M", "4096": bytes (K/M/G binary multiples).
bool parse_remote_size(std::string_view text, uint64_t& out) {
  uint64_t n = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), n);
  if (ec != std::errc() || end == text.data()) return false;
  std::string_view suffix(end, static_cast<size_t>(text.data() + text.size() - end));
  unsigned shift = 0;
  if (suffix == "K" || suffix == "k") shift = 10;
  else if (suffix == "M" || suffix == "m") shift = 20;
  else if (suffix == "G" || suffix == "g") shift = 30;
  else if (!suffix.empty()) return false;
  if (shift && n > (UINT64_MAX >> shift)) return false;
  out = n << shift;
  return true;
}

bool parse_remote_uint(std::string_view text, unsigned& out) {
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), out);
  return ec == std::errc() && end == text.data() + text.size();
}

Result<std::string> read_secret_file(std::string_view key, std::string_view path) {
  std::ifstream in{std::string(path)};
  if (!in) return Status::errorf(ENOENT, "option {}: cannot read '{}'", key, path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string trimmed(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return std::string(s);
}

Status add_header_lines(RemoteOptions& o, std::string_view key, std::string_view path) {
  auto text = read_secret_file(key, path);
  if (!text) return text.status();
  std::istringstream lines(*text);
  for (std::string line; std::getline(lines, line);) {
    std::string h = trimmed(line);
    if (h.empty() || h[0] == '#') continue;
    if (h.find(':') == std::string::npos || h.find_first_of("\r\n") != std::string::npos)
      return Status::errorf(EINVAL, "option {}: '{}' has a line that is not 'Name: value'", key, path);
    o.headers.push_back(std::move(h));
  }
  return Status::ok();
}

Status add_bearer_token(RemoteOptions& o, std::string_view key, std::string_view path) {
  auto text = read_secret_file(key, path);
  if (!text) return text.status();
  std::string token = trimmed(*text);
  if (token.empty() || token.find_first_of(" \r\n") != std::string::npos)
    return Status::errorf(EINVAL, "option {}: '{}' does not hold one token", key, path);
  o.headers.push_back("Authorization: Bearer " + token);
  return Status::ok();
}

// The remote options that take a size; nullptr for any other key.
uint64_t* size_field(RemoteOptions& o, std::string_view key) {
  if (key == "remote-block-size") return &o.block_size;
  if (key == "remote-cache-size") return &o.cache_size;
  if (key == "remote-readahead") return &o.readahead;
  if (key == "remote-cache-dir-size") return &o.cache_dir_size;
  return nullptr;
}

Result<bool> apply_known(RemoteOptions& o, std::string_view key, std::string_view value) {
  if (uint64_t* field = size_field(o, key)) {
    uint64_t n = 0;
    if (!parse_remote_size(value, n)) return bad_remote_value(key, value, "a size such as 256K or 1M");
    if (key == "remote-block-size" && (n < 4096 || n > (64u << 20) || (n & (n - 1))))
      return bad_remote_value(key, value, "a power of two from 4K to 64M");
    *field = n;
  } else if (key == "remote-timeout") {
    unsigned s = 0;
    if (!parse_remote_uint(value, s) || s < 1 || s > 3600) return bad_remote_value(key, value, "seconds from 1 to 3600");
    o.timeout_ms = s * 1000;
  } else if (key == "remote-connections") {
    unsigned n = 0;
    if (!parse_remote_uint(value, n) || n < 1 || n > 64) return bad_remote_value(key, value, "a number from 1 to 64");
    o.connections = n;
  } else if (key == "remote-threads") {
    unsigned n = 0;
    if (!parse_remote_uint(value, n) || n < 1 || n > 8) return bad_remote_value(key, value, "a number from 1 to 8");
    o.network_threads = n;
  } else if (key == "remote-cache-dir") {
    if (value.empty()) return bad_remote_value(key, value, "a directory");
    std::error_code ec;
    auto dir = std::filesystem::absolute(std::filesystem::path(value), ec);  // the daemon leaves its directory
    if (ec) return bad_remote_value(key, value, "a directory");
    o.cache_dir = dir.string();
  } else if (key == "sslverify") {
    if (value != "on" && value != "off") return bad_remote_value(key, value, "on or off");
    o.ssl_verify = value == "on";
  } else if (key == "cafile") {
    if (value.empty()) return bad_remote_value(key, value, "a file of CA certificates");
    o.ca_file = std::string(value);
  } else if (key == "s3-endpoint") {
    if (!value.starts_with("http://") && !value.starts_with("https://"))
      return bad_remote_value(key, value, "an http:// or https:// URL");
    o.s3_endpoint = std::string(value);
    while (o.s3_endpoint.ends_with('/')) o.s3_endpoint.pop_back();
  } else if (key == "s3-region") {
    if (value.empty()) return bad_remote_value(key, value, "a region such as us-east-1");
    o.s3_region = std::string(value);
  } else if (key == "s3-addressing") {
    if (value != "path" && value != "virtual") return bad_remote_value(key, value, "path or virtual");
    o.s3_addressing = std::string(value);
  } else if (key == "header-file") {
    QCOWFS_TRY(add_header_lines(o, key, value));
  } else if (key == "token-file") {
    QCOWFS_TRY(add_bearer_token(o, key, value));
  } else {
    return false;
  }
  return true;
}

}  // namespace

Result<bool> apply_remote_option(RemoteOptions& o, std::string_view key, std::string_view value) {
  auto known = apply_known(o, key, value);
  if (known && *known) o.set_by_user = true;
  return known;
}

Status apply_remote_option_list(RemoteOptions& o, std::string_view list) {
  while (!list.empty()) {
    size_t comma = list.find(',');
    std::string_view opt = list.substr(0, comma);
    size_t eq = opt.find('=');
    if (eq == std::string_view::npos) return Status::errorf(EINVAL, "remote option '{}' has no value", opt);
    auto known = apply_remote_option(o, opt.substr(0, eq), opt.substr(eq + 1));
    if (!known) return known.status();
    if (!*known) return Status::errorf(EINVAL, "unknown remote option '{}'", opt);
    if (comma == std::string_view::npos) break;
    list.remove_prefix(comma + 1);
  }
  return Status::ok();
}

Result<RemoteOptions> effective_remote_options(const RemoteOptions& o) {
  RemoteOptions out = o;
  const char* env = std::getenv("QCOWFS_REMOTE_OPTIONS");
  if (o.set_by_user || !env) return out;
  if (Status st = apply_remote_option_list(out, env); !st) return st.with_context("QCOWFS_REMOTE_OPTIONS");
  return out;
}

bool has_url_scheme(std::string_view name) {
  size_t sep = name.find("://");
  if (sep == std::string_view::npos || sep == 0) return false;
  for (char c : name.substr(0, sep)) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '+' && c != '-' && c != '.') return false;
  }
  return true;
}

bool is_remote_location(std::string_view name) {
  return name.starts_with("http://") || name.starts_with("https://") || name.starts_with("s3://") ||
         name.starts_with("nbd://") ||
         name.starts_with("nbd+unix://");
}

}  // namespace qcowfs::io
