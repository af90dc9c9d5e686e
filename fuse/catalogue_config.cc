#include "fuse/catalogue_config.h"

#include <fnmatch.h>
#include <sys/stat.h>

#include <cerrno>
#include <fstream>
#include <sstream>

#include "image/crypto/secret.h"
#include "image/format.h"

namespace qcowfs::fuse {
namespace {

std::string_view trim(std::string_view s) {
  const size_t first = s.find_first_not_of(" \t\r");
  if (first == std::string_view::npos) return {};
  const size_t last = s.find_last_not_of(" \t\r");
  return s.substr(first, last - first + 1);
}

}  // namespace

Status CatalogueConfig::apply(Rule& rule, std::string_view option, const std::string& srcdir) {
  const size_t eq = option.find('=');
  const std::string_view key = option.substr(0, eq);
  const std::string_view value = eq == std::string_view::npos ? std::string_view{} : option.substr(eq + 1);
  if (option == "rw" || option == "ro") {
    rule.writable = option == "rw";
  } else if (key == "cache" && eq != std::string_view::npos) {
    auto mode = io::parse_cache_mode(value);
    if (!mode) return Status::errorf(EINVAL, "bad value '{}' for cache (expected none, writethrough, writeback or unsafe)", value);
    rule.cache = *mode;
  } else if (key == "key-file" && !value.empty()) {
    std::string path(value);
    if (path.front() != '/') path = srcdir + "/" + path;
    rule.keys = image::crypto::KeyProvider::from_file(std::move(path));
  } else if (key == "format" && eq != std::string_view::npos) {
    const image::FormatInfo* f = image::find_format(value);
    if (!f || !f->supported())
      return Status::errorf(EINVAL, "bad value '{}' for format (expected {})", value, image::supported_format_names());
    rule.format = std::string(f->name);
  } else {
    return Status::errorf(EINVAL, "unknown option '{}' (expected rw, ro, cache=, key-file= or format=)", option);
  }
  return Status::ok();
}

Result<CatalogueConfig> CatalogueConfig::parse(std::string_view text, std::string_view where,
                                               const std::string& srcdir) {
  CatalogueConfig config;
  size_t line_no = 0;
  while (!text.empty()) {
    const size_t eol = text.find('\n');
    const std::string_view line = trim(text.substr(0, eol));
    text.remove_prefix(eol == std::string_view::npos ? text.size() : eol + 1);
    ++line_no;
    if (line.empty() || line.front() == '#') continue;
    const size_t space = line.find_first_of(" \t");
    if (space == std::string_view::npos)
      return Status::errorf(EINVAL, "{}:{}: expected 'PATTERN OPTION[,OPTION...]'", where, line_no);
    Rule rule;
    rule.pattern = std::string(line.substr(0, space));
    std::string_view options = trim(line.substr(space));
    while (true) {
      const size_t comma = options.find(',');
      Status st = apply(rule, trim(options.substr(0, comma)), srcdir);
      if (!st) return Status::errorf(EINVAL, "{}:{}: {}", where, line_no, st.message());
      if (comma == std::string_view::npos) break;
      options.remove_prefix(comma + 1);
    }
    config.rules_.push_back(std::move(rule));
  }
  return config;
}

Result<CatalogueConfig> CatalogueConfig::load(const std::string& srcdir) {
  const std::string path = srcdir + "/" + std::string(kCatalogueConfigName);
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return CatalogueConfig{};
    return Status::from_errno(errno, path);
  }
  std::ifstream in(path);
  if (!in) return Status::errorf(EACCES, "{}: cannot read it", path);
  std::ostringstream text;
  text << in.rdbuf();
  return parse(text.str(), path, srcdir);
}

image::ImageOptions CatalogueConfig::options_for(std::string_view rel, const image::ImageOptions& defaults) const {
  image::ImageOptions o = defaults;
  const std::string name(rel);
  for (const Rule& r : rules_) {
    if (::fnmatch(r.pattern.c_str(), name.c_str(), FNM_PATHNAME) != 0) continue;
    if (r.writable) o.file.writable = *r.writable;
    if (r.cache) o.file.cache = *r.cache;
    if (r.keys) o.keys = r.keys;
    if (!r.format.empty()) o.format = r.format;
  }
  return o;
}

bool CatalogueConfig::any_writable() const {
  for (const Rule& r : rules_)
    if (r.writable.value_or(false)) return true;
  return false;
}

}  // namespace qcowfs::fuse
