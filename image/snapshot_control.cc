#include "image/snapshot_control.h"

#include <json-c/json.h>

#include <memory>
#include <utility>

namespace qcowfs::image {
namespace {

struct ControlJsonPut {
  void operator()(json_object* o) const { json_object_put(o); }
};
using ControlJson = std::unique_ptr<json_object, ControlJsonPut>;

constexpr std::pair<ControlOp, const char*> kControlOps[] = {
    {ControlOp::list, "list"}, {ControlOp::create, "create"}, {ControlOp::apply, "apply"}, {ControlOp::remove, "delete"},
    {ControlOp::external, "external"}};

void control_put_string(json_object* o, const char* key, const std::string& v) {
  json_object_object_add(o, key, json_object_new_string_len(v.data(), static_cast<int>(v.size())));
}
void control_put_uint(json_object* o, const char* key, uint64_t v) {
  json_object_object_add(o, key, json_object_new_uint64(v));
}

json_object* control_member(json_object* o, const char* key) {
  json_object* out = nullptr;
  if (!o || !json_object_is_type(o, json_type_object) || !json_object_object_get_ex(o, key, &out)) return nullptr;
  return out;
}
std::string control_member_string(json_object* o, const char* key) {
  json_object* v = control_member(o, key);
  if (!v || !json_object_is_type(v, json_type_string)) return {};
  return std::string(json_object_get_string(v), static_cast<size_t>(json_object_get_string_len(v)));
}
uint64_t control_member_uint(json_object* o, const char* key) {
  json_object* v = control_member(o, key);
  return v && json_object_is_type(v, json_type_int) ? json_object_get_uint64(v) : 0;
}

std::string control_render_line(json_object* o) {
  ControlJson owner(o);
  return json_object_to_json_string_ext(o, JSON_C_TO_STRING_PLAIN | JSON_C_TO_STRING_NOSLASHESCAPE);
}

Result<ControlJson> control_parse_line(const std::string& line) {
  json_tokener* tok = json_tokener_new();
  if (!tok) return Status::error(ENOMEM, "json_tokener_new");
  ControlJson o(json_tokener_parse_ex(tok, line.data(), static_cast<int>(line.size())));
  const bool bad = json_tokener_get_error(tok) != json_tokener_success;
  json_tokener_free(tok);
  if (bad || !o || !json_object_is_type(o.get(), json_type_object))
    return Status::error(EPROTO, "a control message that is not a JSON object");
  return o;
}

json_object* control_entry_json(const SnapshotEntry& e) {
  json_object* o = json_object_new_object();
  control_put_string(o, "id", e.info.id);
  control_put_string(o, "name", e.info.name);
  control_put_uint(o, "vm_state_size", e.info.vm_state_size);
  control_put_uint(o, "disk_size", e.info.disk_size);
  control_put_uint(o, "date_sec", e.info.date_sec);
  control_put_uint(o, "date_nsec", e.info.date_nsec);
  control_put_uint(o, "vm_clock_ns", e.info.vm_clock_ns);
  if (e.icount) control_put_uint(o, "icount", *e.icount);
  return o;
}

SnapshotEntry control_entry_of(json_object* o) {
  SnapshotEntry e;
  e.info.id = control_member_string(o, "id");
  e.info.name = control_member_string(o, "name");
  e.info.vm_state_size = control_member_uint(o, "vm_state_size");
  e.info.disk_size = control_member_uint(o, "disk_size");
  e.info.date_sec = control_member_uint(o, "date_sec");
  e.info.date_nsec = static_cast<uint32_t>(control_member_uint(o, "date_nsec"));
  e.info.vm_clock_ns = control_member_uint(o, "vm_clock_ns");
  if (control_member(o, "icount")) e.icount = control_member_uint(o, "icount");
  return e;
}

}  // namespace

std::string encode_request(const ControlRequest& r) {
  json_object* o = json_object_new_object();
  for (auto [op, name] : kControlOps)
    if (op == r.op) control_put_string(o, "op", name);
  if (!r.id.empty()) control_put_string(o, "id", r.id);
  if (r.op != ControlOp::list) control_put_string(o, "name", r.name);
  return control_render_line(o);
}

Result<ControlRequest> decode_request(const std::string& line) {
  auto o = control_parse_line(line);
  if (!o) return o.status();
  const std::string op = control_member_string(o->get(), "op");
  ControlRequest r;
  bool known = false;
  for (auto [value, name] : kControlOps) {
    if (op != name) continue;
    r.op = value;
    known = true;
  }
  if (!known) return Status::errorf(EPROTO, "unknown control operation '{}'", op);
  r.id = control_member_string(o->get(), "id");
  r.name = control_member_string(o->get(), "name");
  return r;
}

std::string encode_reply(const ControlReply& r) {
  json_object* o = json_object_new_object();
  json_object_object_add(o, "code", json_object_new_int(r.status.code()));
  control_put_string(o, "message", r.status.message());
  json_object* list = json_object_new_array();
  for (const SnapshotEntry& e : r.snapshots) json_object_array_add(list, control_entry_json(e));
  json_object_object_add(o, "snapshots", list);
  return control_render_line(o);
}

Result<ControlReply> decode_reply(const std::string& line) {
  auto o = control_parse_line(line);
  if (!o) return o.status();
  ControlReply r;
  const auto code = static_cast<int>(control_member_uint(o->get(), "code"));
  if (code != 0) r.status = Status::error(code, control_member_string(o->get(), "message"));
  json_object* list = control_member(o->get(), "snapshots");
  if (list && json_object_is_type(list, json_type_array))
    for (size_t i = 0; i < json_object_array_length(list); ++i)
      r.snapshots.push_back(control_entry_of(json_object_array_get_idx(list, i)));
  return r;
}

}  // namespace qcowfs::image
