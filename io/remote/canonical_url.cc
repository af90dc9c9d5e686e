#include "io/remote/canonical_url.h"

#include <curl/curl.h>

#include <algorithm>
#include <cctype>
#include <climits>
#include <filesystem>
#include <memory>
#include <optional>
#include <vector>

#include <fmt/format.h>

namespace qcowfs::io {
namespace {

struct CurlUrlDeleter {
  void operator()(CURLU* u) const { curl_url_cleanup(u); }
};
using CurlUrl = std::unique_ptr<CURLU, CurlUrlDeleter>;

struct CurlFree {
  void operator()(char* p) const { curl_free(p); }
};
using CurlString = std::unique_ptr<char, CurlFree>;

constexpr unsigned kNbdDefaultPort = 10809;

// One part of a parsed URL ("" when absent), or nullopt when curl refuses it
// (decoding it with CURLU_URLDECODE may meet a %00, for one).
std::optional<std::string> url_part(CURLU* u, CURLUPart part, unsigned flags = 0) {
  char* raw = nullptr;
  const CURLUcode rc = curl_url_get(u, part, &raw, flags);
  CurlString owned(raw);
  if (rc == CURLUE_OK) return std::string(raw ? raw : "");
  const bool absent = rc == CURLUE_NO_QUERY || rc == CURLUE_NO_PORT || rc == CURLUE_NO_USER ||
                      rc == CURLUE_NO_PASSWORD || rc == CURLUE_NO_FRAGMENT || rc == CURLUE_NO_HOST;
  return absent ? std::optional<std::string>("") : std::nullopt;
}

std::string ascii_lower(std::string s) {
  std::ranges::transform(s, s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

// Percent-decoding and -encoding, as curl does them (every byte but
// A-Z a-z 0-9 - . _ ~ encoded, so the form is unambiguous). curl reads a
// length of 0 as "up to the NUL": "" is answered here.
std::optional<std::string> url_decode(std::string_view s) {
  if (s.empty()) return std::string();
  if (s.size() > INT_MAX) return std::nullopt;
  int n = 0;
  CurlString out(curl_easy_unescape(nullptr, s.data(), static_cast<int>(s.size()), &n));
  if (!out) return std::nullopt;
  return std::string(out.get(), static_cast<size_t>(n));
}

std::optional<std::string> url_encode(std::string_view s) {
  if (s.empty()) return std::string();
  if (s.size() > INT_MAX) return std::nullopt;
  CurlString out(curl_easy_escape(nullptr, s.data(), static_cast<int>(s.size())));
  if (!out) return std::nullopt;
  return std::string(out.get());
}

// The pieces of s between the separators (std::views::split does not build
// with clang over libstdc++ 12).
std::vector<std::string_view> pieces(std::string_view s, char separator) {
  std::vector<std::string_view> out;
  for (size_t from = 0;;) {
    const size_t at = s.find(separator, from);
    out.push_back(s.substr(from, at == std::string_view::npos ? std::string_view::npos : at - from));
    if (at == std::string_view::npos) return out;
    from = at + 1;
  }
}

// A decoded path encoded again segment by segment, '/' kept: one spelling
// for each path (CURLU_URLENCODE would keep a '%' that was encoded before).
std::optional<std::string> encode_path(std::string_view path) {
  std::string out;
  bool first = true;
  for (std::string_view piece : pieces(path, '/')) {
    auto segment = url_encode(piece);
    if (!segment) return std::nullopt;
    out += (first ? "" : "/") + *segment;
    first = false;
  }
  return out;
}

std::optional<CurlUrl> parse(const std::string& url, unsigned flags) {
  CurlUrl u(curl_url());
  if (!u || curl_url_set(u.get(), CURLUPART_URL, url.c_str(), flags) != CURLUE_OK) return std::nullopt;
  return u;
}

// Lower-cases a host name in place; an IPv6 literal ("[...]") curl has
// already written in its normal form.
bool lower_host(CURLU* u) {
  auto host = url_part(u, CURLUPART_HOST);
  if (!host) return false;
  if (host->empty() || host->front() == '[') return true;
  return curl_url_set(u, CURLUPART_HOST, ascii_lower(*host).c_str(), 0) == CURLUE_OK;
}

std::optional<std::string> canonical_http(const std::string& url) {
  auto u = parse(url, CURLU_URLENCODE);
  if (!u || !lower_host(u->get())) return std::nullopt;
  // The password authenticates, it names nothing; the fragment is never sent.
  // The query stays: for a presigned S3 URL (X-Amz-Signature=...) it is part
  // of the object's address, and any server may answer by it.
  if (curl_url_set(u->get(), CURLUPART_PASSWORD, nullptr, 0) != CURLUE_OK ||
      curl_url_set(u->get(), CURLUPART_FRAGMENT, nullptr, 0) != CURLUE_OK)
    return std::nullopt;
  return url_part(u->get(), CURLUPART_URL, CURLU_NO_DEFAULT_PORT);
}

// An nbd+unix socket path: absolute, its realpath when the file exists (the
// lexically normal form of what does not).
std::string canonical_socket_path(const std::string& path) {
  std::error_code ec;
  std::filesystem::path p = std::filesystem::absolute(path, ec);
  if (ec) return path;
  std::filesystem::path canonical = std::filesystem::weakly_canonical(p, ec);
  return ec ? p.lexically_normal().string() : canonical.string();
}

// The query's parameters decoded, the unix socket's path made canonical,
// encoded again and sorted.
std::optional<std::string> canonical_nbd_query(const std::string& query, bool unix_socket) {
  std::vector<std::string> params;
  for (std::string_view param : pieces(query, '&')) {
    if (param.empty()) continue;
    const size_t eq = param.find('=');
    auto name = url_decode(param.substr(0, eq));
    auto value = url_decode(eq == std::string_view::npos ? std::string_view() : param.substr(eq + 1));
    if (!name || !value) return std::nullopt;
    if (unix_socket && *name == "socket") *value = canonical_socket_path(*value);
    auto ename = url_encode(*name), evalue = url_encode(*value);
    if (!ename || !evalue) return std::nullopt;
    params.push_back(eq == std::string_view::npos ? *ename : *ename + "=" + *evalue);
  }
  std::ranges::sort(params);
  std::string out;
  for (const std::string& p : params) out += (out.empty() ? "" : "&") + p;
  return out;
}

// nbd:// and nbd+unix://. curl reads "scheme:///path" as a host named
// "path" (its leniency for "http:///host"), so an empty authority, the usual
// nbd+unix form, is given curl as "localhost".
std::optional<std::string> canonical_nbd(const std::string& url, std::string_view scheme) {
  const std::string prefix = fmt::format("{}://", scheme);
  const bool no_authority = url.starts_with(prefix + "/");
  const std::string parsed = no_authority ? prefix + "localhost" + url.substr(prefix.size()) : url;
  auto u = parse(parsed, CURLU_NON_SUPPORT_SCHEME | CURLU_PATH_AS_IS);
  if (!u || !lower_host(u->get())) return std::nullopt;
  auto host = url_part(u->get(), CURLUPART_HOST);
  auto port = url_part(u->get(), CURLUPART_PORT);
  auto user = url_part(u->get(), CURLUPART_USER);
  auto path = url_part(u->get(), CURLUPART_PATH, CURLU_URLDECODE);
  auto query = url_part(u->get(), CURLUPART_QUERY);
  if (!host || !port || !user || !path || !query || !user->empty()) return std::nullopt;
  auto export_path = encode_path(*path);
  auto params = canonical_nbd_query(*query, scheme == "nbd+unix");
  if (!export_path || !params) return std::nullopt;
  // Over a unix socket libnbd ignores the authority (a host, a port).
  if (scheme == "nbd+unix") {
    host->clear();
    port->clear();
  }
  if (*port == std::to_string(kNbdDefaultPort)) port->clear();
  return fmt::format("{}://{}{}{}{}{}", scheme, *host, port->empty() ? "" : ":", *port, *export_path,
                     params->empty() ? "" : "?" + *params);
}

// The text up to the first '?' or '#', and of the authority's
// "user:password@" only "user@" (the authority ends at the first '/'; a
// userinfo holds no '/', '?' or '#'). Cut as text, not parsed: it must work
// without libcurl (whose absence the message that shows the URL reports) and
// on URLs curl refuses.
std::string printable_http(const std::string& url) {
  const std::string s = url.substr(0, url.find_first_of("?#"));
  const size_t begin = s.find("://");
  if (begin == std::string::npos) return s;
  const size_t from = begin + 3;
  const size_t end = std::min(s.find('/', from), s.size());
  const size_t at = s.rfind('@', end - 1);
  const size_t colon = s.find(':', from);
  if (at == std::string::npos || at < from || colon == std::string::npos || colon > at) return s;
  return s.substr(0, colon) + s.substr(at);
}

}  // namespace

std::string printable_remote_location(std::string_view url) {
  const std::string text(url);
  if (text.starts_with("http://") || text.starts_with("https://")) return printable_http(text);
  return text;
}

std::string canonical_remote_location(std::string_view url) {
  const std::string text(url);
  std::optional<std::string> canonical;
  if (text.starts_with("http://") || text.starts_with("https://")) canonical = canonical_http(text);
  else if (text.starts_with("nbd://")) canonical = canonical_nbd(text, "nbd");
  else if (text.starts_with("nbd+unix://")) canonical = canonical_nbd(text, "nbd+unix");
  return canonical.value_or(text);
}

}  // namespace qcowfs::io
