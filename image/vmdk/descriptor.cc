#include "image/vmdk/descriptor.h"

#include <array>
#include <cctype>
#include <cstring>
#include <limits>

#include "image/vmdk/format.h"

namespace qcowfs::image::vmdk {
namespace {

constexpr std::array kCreateTypes = {"monolithicFlat",    "vmfs", "vmfsSparse", "seSparse", "twoGbMaxExtentSparse",
                                     "twoGbMaxExtentFlat"};
constexpr std::array kExtentTypes = {"FLAT", "SPARSE", "VMFS", "VMFSSPARSE", "SESPARSE"};

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r'; }

// A cursor with sscanf()'s conversions over the rest of the text.
class Scanner {
 public:
  explicit Scanner(std::string_view s) : s_(s) {}
  bool at_end() const { return i_ >= s_.size(); }
  void skip_space() {
    while (!at_end() && is_space(s_[i_])) ++i_;
  }
  // %<width>s
  bool word(size_t width, std::string& out) {
    skip_space();
    size_t start = i_;
    while (!at_end() && !is_space(s_[i_]) && i_ - start < width) ++i_;
    out.assign(s_.substr(start, i_ - start));
    return i_ > start;
  }
  // %<SCNd64>: strtoll's rules, clamped on overflow.
  bool int64(int64_t& out) {
    skip_space();
    size_t j = i_;
    bool neg = false;
    if (j < s_.size() && (s_[j] == '+' || s_[j] == '-')) neg = s_[j++] == '-';
    size_t digits = j;
    unsigned __int128 v = 0;
    while (j < s_.size() && s_[j] >= '0' && s_[j] <= '9') {
      if (v <= std::numeric_limits<uint64_t>::max()) v = v * 10 + static_cast<unsigned>(s_[j] - '0');
      ++j;
    }
    if (j == digits) return false;
    i_ = j;
    const auto max = static_cast<unsigned __int128>(std::numeric_limits<int64_t>::max());
    if (neg)
      out = v > max ? std::numeric_limits<int64_t>::min() : -static_cast<int64_t>(v);
    else
      out = v > max ? std::numeric_limits<int64_t>::max() : static_cast<int64_t>(v);
    return true;
  }
  bool literal(char c) {
    if (at_end() || s_[i_] != c) return false;
    ++i_;
    return true;
  }
  // %<width>[^\n\r"]
  bool name(size_t width, std::string& out) {
    size_t start = i_;
    while (!at_end() && s_[i_] != '\n' && s_[i_] != '\r' && s_[i_] != '"' && i_ - start < width) ++i_;
    out.assign(s_.substr(start, i_ - start));
    return i_ > start;
  }

 private:
  std::string_view s_;
  size_t i_ = 0;
};

struct ExtentLine {
  int matches = 0;
  std::string access, type, file;
  int64_t sectors = 0;
  int64_t flat_offset = -1;
};

// sscanf(p, "%10s %" SCNd64 " %10s \"%511[^\n\r\"]\" %" SCNd64, ...)
ExtentLine scan_extent_line(std::string_view rest) {
  ExtentLine l;
  Scanner s(rest);
  if (!s.word(10, l.access)) return l;
  l.matches = 1;
  if (!s.int64(l.sectors)) return l;
  l.matches = 2;
  if (!s.word(10, l.type)) return l;
  l.matches = 3;
  s.skip_space();
  if (!s.literal('"') || !s.name(kMaxExtentName, l.file)) return l;
  l.matches = 4;
  if (!s.literal('"')) return l;
  if (!s.int64(l.flat_offset)) return l;
  l.matches = 5;
  return l;
}

bool known_type(const std::string& t) {
  for (const char* k : kExtentTypes)
    if (t == k) return true;
  return false;
}

std::string_view line_at(std::string_view text, size_t p) {
  size_t nl = text.find('\n', p);
  return text.substr(p, nl == std::string_view::npos ? std::string_view::npos : nl - p);
}

std::string_view window(std::string_view text, size_t n) { return c_string(text.substr(0, std::min(text.size(), n))); }

}  // namespace

std::string_view c_string(std::string_view text) {
  size_t nul = text.find('\0');
  return nul == std::string_view::npos ? text : text.substr(0, nul);
}

Result<std::string> descriptor_create_type(std::string_view text) {
  text = c_string(text);
  size_t pos = text.find("createType");
  if (pos == std::string_view::npos) return Status::errorf(EINVAL, "invalid VMDK image descriptor (no createType)");
  size_t start = pos + std::strlen("createType") + 2;
  if (start >= text.size()) return Status::errorf(EINVAL, "invalid VMDK image descriptor (createType)");
  size_t end = text.find('"', start);
  if (end == std::string_view::npos || end - start > kMaxCreateType)
    return Status::errorf(EINVAL, "invalid VMDK image descriptor (createType)");
  std::string ct(text.substr(start, end - start));
  for (const char* k : kCreateTypes)
    if (ct == k) return ct;
  return Status::errorf(ENOTSUP, "unsupported VMDK image type '{}'", ct);
}

Result<std::vector<DescriptorExtent>> descriptor_extents(std::string_view text) {
  text = c_string(text);
  std::vector<DescriptorExtent> out;
  for (size_t p = 0; p < text.size();) {
    size_t nl = text.find('\n', p);
    size_t next = nl == std::string_view::npos ? text.size() : nl + 1;
    ExtentLine l = scan_extent_line(text.substr(p));
    bool invalid = false;
    if (l.matches < 4 || l.access != "RW") {
      p = next;
      continue;
    } else if (l.type == "FLAT") {
      invalid = l.matches != 5 || l.flat_offset < 0;
    } else if (l.type == "VMFS") {
      invalid = l.matches != 4;
      l.flat_offset = 0;
    } else {
      invalid = l.matches != 4;
    }
    if (invalid) return Status::errorf(EINVAL, "invalid VMDK extent line: {}", line_at(text, p));
    if (l.type != "FLAT" && l.type != "VMFS") l.flat_offset = 0;
    if (l.sectors > 0 && known_type(l.type)) {
      if (out.size() == kMaxExtents)
        return Status::errorf(EINVAL, "VMDK descriptor lists more than {} extents", kMaxExtents);
      out.push_back(DescriptorExtent{l.type, l.sectors, l.file, l.flat_offset});
    }
    p = next;
  }
  return out;
}

Result<uint32_t> descriptor_cid(std::string_view text, bool parent) {
  std::string_view w = window(text, kDescWindow - 1);
  std::string_view key = parent ? "parentCID" : "CID";
  size_t pos = w.find(key);
  if (pos == std::string_view::npos) return Status::errorf(EINVAL, "VMDK descriptor has no {}", key);
  size_t i = pos + key.size() + 1;  // sizeof("CID"): the key and one more byte ('=')
  // sscanf("%" SCNx32): spaces, an optional sign and 0x, hex digits.
  while (i < w.size() && is_space(w[i])) ++i;
  bool neg = false;
  if (i < w.size() && (w[i] == '+' || w[i] == '-')) neg = w[i++] == '-';
  if (i + 2 < w.size() && w[i] == '0' && (w[i + 1] == 'x' || w[i + 1] == 'X') &&
      std::isxdigit(static_cast<unsigned char>(w[i + 2])))
    i += 2;
  uint64_t v = 0;
  bool any = false, overflow = false;
  for (; i < w.size() && std::isxdigit(static_cast<unsigned char>(w[i])); ++i) {
    any = true;
    unsigned d =
        static_cast<unsigned>(std::isdigit(static_cast<unsigned char>(w[i])) ? w[i] - '0' : (w[i] | 0x20) - 'a' + 10);
    if (v >> 60) overflow = true;
    v = v << 4 | d;
  }
  if (!any) return Status::errorf(EINVAL, "VMDK descriptor: {} is not a hex number", key);
  if (overflow) v = std::numeric_limits<uint64_t>::max();
  if (neg) v = 0 - v;
  return static_cast<uint32_t>(v);
}

Result<std::optional<std::string>> descriptor_parent_hint(std::string_view text) {
  std::string_view w = window(text, kDescWindow);
  size_t pos = w.find("parentFileNameHint");
  if (pos == std::string_view::npos) return std::optional<std::string>();
  size_t start = pos + std::strlen("parentFileNameHint") + 2;  // the key, '=' and '"'
  size_t end = start <= w.size() ? w.find('"', start) : std::string_view::npos;
  if (end == std::string_view::npos) return Status::errorf(EINVAL, "VMDK descriptor: unterminated parentFileNameHint");
  if (end - start > kMaxParentHint) return Status::errorf(EINVAL, "VMDK descriptor: parentFileNameHint is too long");
  return std::optional<std::string>(std::string(w.substr(start, end - start)));
}

Result<std::string> descriptor_with_cid(std::string_view text, uint32_t cid) {
  const std::string_view w = c_string(text.substr(0, std::min(text.size(), kDescWindow - 1)));
  const size_t parent = w.find("parentCID");
  if (parent == std::string_view::npos) return Status::error(EINVAL, "VMDK descriptor: no parentCID to keep");
  const size_t at = w.find("CID");
  // sizeof("CID") steps over the name and the character after it ('=').
  if (at == std::string_view::npos || at + 4 > w.size() || w[at + 3] != '=')
    return Status::error(EINVAL, "VMDK descriptor: no CID= to update");
  std::string out(w.substr(0, at + 4));
  out += fmt::format("{:x}\n", cid);
  out += w.substr(parent);
  if (out.size() > kDescWindow - 1) out.resize(kDescWindow - 1);
  return out;
}

Result<Descriptor> parse_descriptor(std::string_view text) {
  Descriptor d;
  auto ct = descriptor_create_type(text);
  if (!ct) return ct.status();
  d.create_type = std::move(*ct);
  auto ex = descriptor_extents(text);
  if (!ex) return ex.status();
  d.extents = std::move(*ex);
  auto hint = descriptor_parent_hint(text);
  if (!hint) return hint.status();
  d.parent_hint = std::move(*hint);
  auto cid = descriptor_cid(text, false);
  if (!cid) return cid.status();
  d.cid = *cid;
  auto pcid = descriptor_cid(text, true);
  if (!pcid) return pcid.status();
  d.parent_cid = *pcid;
  return d;
}

}  // namespace qcowfs::image::vmdk
