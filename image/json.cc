#include "image/json.h"

#include <fmt/format.h>

namespace qcowfs::image {

bool Json::empty() const {
  if (const auto* o = std::get_if<Object>(&v_)) return o->empty();
  if (const auto* a = std::get_if<Array>(&v_)) return a->empty();
  return false;
}

const Json::Object& Json::members() const {
  static const Object kNone;
  const auto* o = std::get_if<Object>(&v_);
  return o ? *o : kNone;
}

const Json::Array& Json::items() const {
  static const Array kNone;
  const auto* a = std::get_if<Array>(&v_);
  return a ? *a : kNone;
}

std::string Json::scalar_text() const {
  if (const auto* b = std::get_if<bool>(&v_)) return *b ? "true" : "false";
  if (const auto* u = std::get_if<uint64_t>(&v_)) return fmt::format("{}", *u);
  if (const auto* i = std::get_if<int64_t>(&v_)) return fmt::format("{}", *i);
  if (const auto* t = std::get_if<std::string>(&v_)) return *t;
  return render_compact();
}

std::string json_quote(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) out += fmt::format("\\u{:04x}", static_cast<unsigned>(c));
        else out += c;
    }
  }
  return out + "\"";
}

Json& Json::set(std::string key, Json value) {
  std::get<Object>(v_).emplace_back(std::move(key), std::move(value));
  return *this;
}

Json& Json::push(Json value) {
  std::get<Array>(v_).push_back(std::move(value));
  return *this;
}

std::string Json::render(int indent) const {
  std::string out;
  render_to(out, indent, 0);
  return out;
}

std::string Json::render_compact() const {
  std::string out;
  render_to(out, -1, 0);
  return out;
}

void Json::render_to(std::string& out, int indent, int level) const {
  auto newline = [&](int lvl) {
    if (indent < 0) return;
    out += '\n';
    out.append(static_cast<size_t>(indent * lvl), ' ');
  };
  if (auto* b = std::get_if<bool>(&v_)) {
    out += *b ? "true" : "false";
  } else if (auto* u = std::get_if<uint64_t>(&v_)) {
    out += fmt::format("{}", *u);
  } else if (auto* i = std::get_if<int64_t>(&v_)) {
    out += fmt::format("{}", *i);
  } else if (auto* s = std::get_if<std::string>(&v_)) {
    out += json_quote(*s);
  } else if (auto* a = std::get_if<Array>(&v_)) {
    out += '[';
    for (size_t k = 0; k < a->size(); ++k) {
      if (k) out += indent < 0 ? ", " : ",";
      newline(level + 1);
      (*a)[k].render_to(out, indent, level + 1);
    }
    if (!a->empty()) newline(level);
    out += ']';
  } else {
    const auto& o = std::get<Object>(v_);
    out += '{';
    for (size_t k = 0; k < o.size(); ++k) {
      if (k) out += indent < 0 ? ", " : ",";
      if (indent < 0 && k == 0) out += ' ';
      newline(level + 1);
      out += json_quote(o[k].first) + ": ";
      o[k].second.render_to(out, indent, level + 1);
    }
    if (!o.empty()) newline(level);
    out += '}';
  }
}

}  // namespace qcowfs::image
