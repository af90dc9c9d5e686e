// The messages of a mount's control socket (io/control_socket.h): one request
// line from `qcowfs snapshot` (tools/snapshot.cc) to the daemon holding the
// image (fuse/live_snapshot.h), one reply line back, each a JSON object
// (written and read with json-c; strings may hold anything, a newline is
// escaped). A request names an operation of image/snapshot.h's SnapshotOps;
// the reply carries the operation's Status (errno and message) and, for list
// and create, the snapshot entries, so the client prints exactly what the
// offline command prints.
//
//   {"op": "list"}                       -> {"code": 0, "message": "", "snapshots": [ENTRY...]}
//   {"op": "create", "name": N}          -> {"code": 0, ..., "snapshots": [ENTRY]}
//   {"op": "apply", "name": N}           -> {"code": E, "message": M}
//   {"op": "delete", "id": I, "name": N} -> {"code": E, "message": M}
//   {"op": "external", "name": PATH}     -> {"code": E, "message": M}
// ENTRY: {"id", "name", "vm_state_size", "disk_size", "date_sec", "date_nsec",
// "vm_clock_ns", "icount" (absent: none)}.
//
// Thread-safety: plain functions on values.
#pragma once

#include <string>
#include <vector>

#include "image/snapshot.h"
#include "io/status.h"

namespace qcowfs::image {

enum class ControlOp { list, create, apply, remove, external };

struct ControlRequest {
  ControlOp op = ControlOp::list;
  std::string id;    // remove
  std::string name;  // create, apply, remove; external: the new overlay's absolute path
};

struct ControlReply {
  Status status;
  std::vector<SnapshotEntry> snapshots;
};

// One line each, without the trailing newline.
std::string encode_request(const ControlRequest& r);
Result<ControlRequest> decode_request(const std::string& line);
std::string encode_reply(const ControlReply& r);
Result<ControlReply> decode_reply(const std::string& line);

}  // namespace qcowfs::image
