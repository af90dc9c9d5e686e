// CatalogueConfig: the per-image options of a catalogue mount (fuse/catalogue.h),
// read once at mount from SRCDIR/.qcowfs.conf when that file exists:
//
//   # comment
//   PATTERN  OPTION[,OPTION...]
//
// PATTERN is a shell glob (fnmatch(3), '*' does not cross '/') matched against
// the image file's path relative to SRCDIR ("vm1.qcow2", "templates/*.vmdk").
// OPTION is one of rw, ro, cache=none|writethrough|writeback|unsafe,
// key-file=PATH (relative to SRCDIR unless absolute) and format=FMT. Every
// line whose pattern matches applies, in file order (a later option wins),
// over the defaults of the mount's -o options (read-only unless -o rw). An
// unknown option or a bad value fails the mount with the line's number.
// Thread-safety: immutable after load(); const methods from any thread.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "image/block_driver.h"
#include "io/host_file.h"
#include "io/status.h"

namespace qcowfs::fuse {

inline constexpr std::string_view kCatalogueConfigName = ".qcowfs.conf";

class CatalogueConfig {
 public:
  // SRCDIR/.qcowfs.conf (srcdir absolute); no file: no rules.
  static Result<CatalogueConfig> load(const std::string& srcdir);
  // The rules in text; `where` names the file in messages, relative key
  // files are taken from srcdir.
  static Result<CatalogueConfig> parse(std::string_view text, std::string_view where, const std::string& srcdir);

  // The options of the image at `rel` (relative to SRCDIR): defaults with
  // every matching rule applied.
  image::ImageOptions options_for(std::string_view rel, const image::ImageOptions& defaults) const;
  // True when some rule makes an image read-write.
  bool any_writable() const;
  size_t rule_count() const { return rules_.size(); }

 private:
  struct Rule {
    std::string pattern;
    std::optional<bool> writable;
    std::optional<io::CacheMode> cache;
    std::shared_ptr<image::crypto::KeyProvider> keys;
    std::string format;
  };
  static Status apply(Rule& rule, std::string_view option, const std::string& srcdir);
  std::vector<Rule> rules_;
};

}  // namespace qcowfs::fuse
