// A minimal JSON value, rendered the way qemu-img prints it (4-space
// indentation, keys in insertion order): drivers describe their format's
// details in it (ImageDetails::specific) and the subcommands print it (--json).
// Thread-safety: plain values.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace qcowfs::image {

class Json {
 public:
  using Array = std::vector<Json>;
  using Object = std::vector<std::pair<std::string, Json>>;

  Json() : v_(Object{}) {}
  Json(bool b) : v_(b) {}                    // NOLINT: implicit by design
  Json(uint64_t n) : v_(n) {}                // NOLINT
  Json(int64_t n) : v_(n) {}                 // NOLINT
  Json(int n) : v_(static_cast<int64_t>(n)) {}  // NOLINT
  Json(std::string s) : v_(std::move(s)) {}  // NOLINT
  Json(const char* s) : v_(std::string(s)) {}  // NOLINT
  Json(Array a) : v_(std::move(a)) {}        // NOLINT
  static Json object() { return Json(); }
  static Json array() { return Json(Array{}); }

  // Object: appends key (no duplicate check). Array: appends a value.
  Json& set(std::string key, Json value);
  Json& push(Json value);
  // An object or array with no members.
  bool empty() const;
  bool is_array() const { return std::holds_alternative<Array>(v_); }
  bool is_container() const { return is_array() || std::holds_alternative<Object>(v_); }
  // Members of an object, items of an array (empty for other values).
  const Object& members() const;
  const Array& items() const;
  // A scalar as qemu-img's human output prints it: 42, true, text unquoted.
  std::string scalar_text() const;

  // Pretty-printed with the given indentation of nested levels.
  std::string render(int indent = 4) const;
  // One line: {"a": 1, "b": 2} (qemu-img map's per-entry style).
  std::string render_compact() const;

 private:
  void render_to(std::string& out, int indent, int level) const;
  std::variant<bool, uint64_t, int64_t, std::string, Array, Object> v_;
};

std::string json_quote(const std::string& s);

}  // namespace qcowfs::image
