#include "io/remote/s3.h"

#include <fcntl.h>
#include <ini.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <mutex>

#include <fmt/format.h>

namespace qcowfs::io {
namespace {

constexpr size_t kMaxIniFile = 1u << 20;
constexpr size_t kMaxIniLine = 16u << 10;

// Debian's inih reads its settings from variables: botocore's rules (no
// inline ';' comments: a secret may hold one), a heap line buffer that grows
// up to kMaxIniLine (longer lines are refused before parsing).
void configure_inih_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    ini_allow_inline_comments = false;
    ini_use_stack = false;
    ini_allow_realloc = true;
    ini_max_line = static_cast<int>(kMaxIniLine + 3);
    ini_stop_on_first_error = true;
  });
}

bool iequals(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) == std::tolower(static_cast<unsigned char>(y));
         });
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

struct IniScan {
  std::string_view section;
  S3Credentials found;
  bool any = false;
  std::string duplicate;  // a key given twice (or continued on a second line)
};

int on_ini_value(void* user, const char* section, const char* name, const char* value) {
  auto* scan = static_cast<IniScan*>(user);
  if (trim(section) != scan->section) return 1;
  std::string* field = nullptr;
  if (iequals(name, "aws_access_key_id")) field = &scan->found.access_key;
  else if (iequals(name, "aws_secret_access_key")) field = &scan->found.secret_key;
  else if (iequals(name, "aws_session_token")) field = &scan->found.session_token;
  else if (iequals(name, "region")) field = &scan->found.region;
  if (!field) return 1;
  if (!field->empty()) {
    scan->duplicate = name;
    return 0;
  }
  *field = value;
  scan->any = true;
  return 1;
}

// The file's content; nullopt when it does not exist. Reads at most one
// byte past the limit (s3_credentials_from_ini refuses such a file).
Result<std::optional<std::string>> read_small_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) {
    if (errno == ENOENT) return std::optional<std::string>();
    return Status::from_errno(errno, path);
  }
  std::string text(kMaxIniFile + 1, '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(fd, text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      return Status::from_errno(err, path);
    }
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  ::close(fd);
  text.resize(got);
  return std::optional<std::string>(std::move(text));
}

std::string env_or(const char* name, std::string fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::string(v) : std::move(fallback);
}

std::string home_file(const char* rel) {
  const char* home = std::getenv("HOME");
  return fmt::format("{}/{}", home && *home ? home : "", rel);
}

// The profile's credentials from one file (nullopt: the file or the section is not there).
Result<std::optional<S3Credentials>> from_file(const std::string& path, const std::string& section) {
  auto text = read_small_file(path);
  if (!text) return text.status();
  if (!*text) return std::optional<S3Credentials>();
  return s3_credentials_from_ini(**text, section, fmt::format("{} [{}]", path, section));
}

}  // namespace

Result<std::optional<S3Credentials>> s3_credentials_from_ini(std::string_view text, std::string_view section,
                                                              std::string_view source) {
  if (text.size() > kMaxIniFile) return Status::errorf(EINVAL, "{}: larger than {} bytes", source, kMaxIniFile);
  if (text.find('\0') != std::string_view::npos) return Status::errorf(EINVAL, "{}: not a text file", source);
  for (size_t pos = 0, line = 1; pos < text.size(); ++line) {
    size_t eol = text.find('\n', pos);
    if (eol == std::string_view::npos) eol = text.size();
    if (eol - pos > kMaxIniLine) return Status::errorf(EINVAL, "{}: line {} is too long", source, line);
    pos = eol + 1;
  }
  configure_inih_once();
  IniScan scan;
  scan.section = section;
  const int rc = ini_parse_string(std::string(text).c_str(), on_ini_value, &scan);
  if (!scan.duplicate.empty()) return Status::errorf(EINVAL, "{}: {} is given twice", source, scan.duplicate);
  if (rc != 0) return Status::errorf(EINVAL, "{}: cannot parse line {}", source, rc);
  if (!scan.any) return std::optional<S3Credentials>();
  scan.found.source = std::string(source);
  return std::optional<S3Credentials>(std::move(scan.found));
}

Result<S3Credentials> resolve_s3_credentials() {
  const std::string id = env_or("AWS_ACCESS_KEY_ID", ""), secret = env_or("AWS_SECRET_ACCESS_KEY", "");
  const std::string profile = env_or("AWS_PROFILE", "default");
  const std::string cred_path = env_or("AWS_SHARED_CREDENTIALS_FILE", home_file(".aws/credentials"));
  const std::string config_path = env_or("AWS_CONFIG_FILE", home_file(".aws/config"));
  // The config file's profile: its region, and credentials when the credentials file has none.
  auto config = from_file(config_path, profile == "default" ? "default" : "profile " + profile);
  if (!config) return config.status();
  if (!id.empty() || !secret.empty()) {
    if (id.empty() || secret.empty())
      return Status::errorf(EACCES, "partial S3 credentials in the environment: set both AWS_ACCESS_KEY_ID and "
                                    "AWS_SECRET_ACCESS_KEY");
    S3Credentials c{id, secret, env_or("AWS_SESSION_TOKEN", ""), "", "the environment (AWS_ACCESS_KEY_ID)"};
    if (*config) c.region = (*config)->region;
    return c;
  }
  auto creds = from_file(cred_path, profile);
  if (!creds) return creds.status();
  std::optional<S3Credentials> found = *creds && !(*creds)->access_key.empty() ? *creds : *config;
  if (!found || found->access_key.empty() || found->secret_key.empty()) {
    return Status::errorf(EACCES, "no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or put "
                                  "aws_access_key_id and aws_secret_access_key under [{}] in {} (profile from "
                                  "AWS_PROFILE; the file from AWS_SHARED_CREDENTIALS_FILE)",
                          profile, cred_path);
  }
  if (*config && found->region.empty()) found->region = (*config)->region;
  return *found;
}

std::string s3_encode_key(std::string_view key) {
  std::string out;
  out.reserve(key.size());
  for (char ch : key) {
    const auto c = static_cast<unsigned char>(ch);
    if (std::isalnum(c) || c == '-' || c == '.' || c == '_' || c == '~' || c == '/') out += ch;
    else out += fmt::format("%{:02X}", c);
  }
  return out;
}

std::string s3_error_summary(std::string_view body) {
  auto element = [&](std::string_view name) -> std::string_view {
    const std::string open = fmt::format("<{}>", name), close = fmt::format("</{}>", name);
    const size_t a = body.find(open);
    if (a == std::string_view::npos) return {};
    const size_t from = a + open.size();
    const size_t b = body.find(close, from);
    if (b == std::string_view::npos) return {};
    return body.substr(from, std::min<size_t>(b - from, 300));
  };
  auto printable = [](std::string_view s) {
    std::string out;
    for (char c : s) out += std::isprint(static_cast<unsigned char>(c)) ? c : ' ';
    return out;
  };
  const std::string_view code = element("Code");
  if (code.empty()) return {};
  const std::string_view message = element("Message");
  return message.empty() ? printable(code) : fmt::format("{}: {}", printable(code), printable(message));
}

Result<std::string> s3_request_url(const std::string& name, RemoteOptions& ro) {
  const std::string_view rest = std::string_view(name).substr(5);
  const size_t slash = rest.find('/');
  if (slash == 0 || slash == std::string_view::npos || slash + 1 == rest.size())
    return Status::errorf(EINVAL, "{}: an S3 location is s3://BUCKET/KEY", name);
  const std::string bucket(rest.substr(0, slash)), key(rest.substr(slash + 1));
  auto creds = resolve_s3_credentials();
  if (!creds) return creds.status().with_context(name);
  const std::string region =
      !ro.s3_region.empty() ? ro.s3_region
                            : env_or("AWS_REGION", env_or("AWS_DEFAULT_REGION", creds->region.empty() ? "us-east-1" : creds->region));
  ro.s3_region = region;
  ro.aws_sigv4 = fmt::format("aws:amz:{}:s3", region);
  ro.aws_userpwd = fmt::format("{}:{}", creds->access_key, creds->secret_key);
  ro.aws_credential_source = creds->source;
  ro.headers.push_back("x-amz-content-sha256: UNSIGNED-PAYLOAD");
  if (!creds->session_token.empty()) ro.headers.push_back(fmt::format("x-amz-security-token: {}", creds->session_token));
  const std::string endpoint =
      ro.s3_endpoint.empty() ? fmt::format("https://s3.{}.amazonaws.com", region) : ro.s3_endpoint;
  const bool virtual_hosted = ro.s3_addressing.empty() ? ro.s3_endpoint.empty() : ro.s3_addressing == "virtual";
  const std::string path = s3_encode_key(key);
  if (!virtual_hosted) return fmt::format("{}/{}/{}", endpoint, s3_encode_key(bucket), path);
  const size_t host = endpoint.find("://") + 3;
  return fmt::format("{}{}.{}/{}", endpoint.substr(0, host), bucket, endpoint.substr(host), path);
}

}  // namespace qcowfs::io
