#include "fuse/filesystem.h"

#include <fuse_lowlevel.h>
#include <linux/fuse.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <utility>

#include "fuse/event_loop.h"
#include "fuse/open_file.h"
#include "fuse/passthrough.h"
#include "fuse/ranges.h"
#include "fuse/request_buffer.h"
#include "io/align.h"
#include "io/log.h"

namespace qcowfs::fuse {
namespace {

constexpr double kAttrTimeout = 1.0;
constexpr double kEntryTimeout = 1.0;
// Enough background requests that QD32 async direct I/O is never throttled.
constexpr unsigned kMaxBackground = 128;
constexpr unsigned kCongestionThreshold = 96;

Filesystem& fs_of(fuse_req_t req) { return *static_cast<Filesystem*>(fuse_req_userdata(req)); }

// Where a READ or WRITE task sends its one reply: a libfuse request, or one
// that Filesystem::serve_direct() decoded itself (its unique id), answered
// with the bytes libfuse would send through EventLoop::send_reply().
class ReplyTo {
 public:
  explicit ReplyTo(fuse_req_t req) : req_(req) {}
  explicit ReplyTo(uint64_t unique) : unique_(unique) {}

  void error(int err) const {
    if (req_) fuse_reply_err(req_, err);
    else EventLoop::send_reply(unique_, -err, {});
  }
  void written(size_t count) const {
    if (req_) {
      fuse_reply_write(req_, count);
      return;
    }
    fuse_write_out out = {};
    out.size = static_cast<uint32_t>(count);
    const iovec arg = {&out, sizeof out};
    EventLoop::send_reply(unique_, 0, {&arg, 1});
  }
  // The first len bytes of buf (none: an empty reply).
  void data(PooledBuffer& buf, size_t len) const {
    if (len == 0) {
      if (req_) fuse_reply_buf(req_, nullptr, 0);
      else EventLoop::send_reply(unique_, 0, {});
    } else if (req_) {
      EventLoop::reply_read(req_, buf, len);
    } else {
      const iovec arg = {buf.data(), len};
      EventLoop::send_reply(unique_, 0, {&arg, 1}, &buf);
    }
  }

 private:
  fuse_req_t req_ = nullptr;
  uint64_t unique_ = 0;
};

void reply_error(ReplyTo to, const Status& st) {
  const int err = st.code() != 0 ? st.code() : EIO;  // saved before anything else runs
  if (err != ENOENT) log::debug("request failed: {}", st.to_string());
  to.error(err);
}

void reply_error(fuse_req_t req, const Status& st) { reply_error(ReplyTo(req), st); }

// The opened image file behind ino for a READ (writing: a WRITE, which a
// read-only image refuses with EROFS), or null and the errno to answer.
std::pair<ImageFile*, int> io_file(const Filesystem& fs, fuse_ino_t ino, bool writing) {
  const Node* node = fs.table().get(ino);
  if (!node) return {nullptr, ENOENT};
  if (node->kind != NodeKind::image) return {nullptr, EISDIR};
  if (!node->file->driver()) return {nullptr, EBADF};  // the kernel sends I/O only after a successful open
  if (writing && node->file->driver()->read_only()) return {nullptr, EROFS};
  return {node->file.get(), 0};
}

void reply_attr(fuse_req_t req, const Filesystem& fs, const Node& node) {
  struct stat st = fs.table().attributes(node, fs.attr_context());
  fuse_reply_attr(req, &st, kAttrTimeout);
}

// The image node behind ino, or nullptr after replying why there is none.
const Node* image_node_or_reply(fuse_req_t req, fuse_ino_t ino) {
  const Node* node = fs_of(req).table().get(ino);
  if (!node) {
    fuse_reply_err(req, ENOENT);
    return nullptr;
  }
  if (node->kind != NodeKind::image) {
    fuse_reply_err(req, EISDIR);
    return nullptr;
  }
  return node;
}

// The opened image file behind ino (its driver() is set), or nullptr after replying.
ImageFile* opened_file_or_reply(fuse_req_t req, fuse_ino_t ino) {
  auto [file, err] = io_file(fs_of(req), ino, false);
  if (!file) fuse_reply_err(req, err);
  return file;
}

// The opened image file behind ino for a request that changes it, or nullptr
// after replying (EROFS on a read-only image).
ImageFile* writable_file_or_reply(fuse_req_t req, fuse_ino_t ino) {
  auto [file, err] = io_file(fs_of(req), ino, true);
  if (!file) fuse_reply_err(req, err);
  return file;
}

// The driver of an opened image file, or nullptr after replying.
image::BlockDriver* driver_or_reply(fuse_req_t req, fuse_ino_t ino) {
  ImageFile* file = opened_file_or_reply(req, ino);
  return file ? file->driver() : nullptr;
}

// ---- request tasks: each replies exactly once when its I/O is done ----

// `buf` (len bytes) is taken while the request is dispatched (see EventLoop::read_buffer()).
// Where the driver gives the range as one host run (image::MappedRead), the task
// reads it itself: no driver coroutine frames between the request and the
// host read, which at 4 KiB were most of a read's own CPU time.
Task<void> read_task(ReplyTo to, image::BlockDriver& d, uint64_t off, size_t len, PooledBuffer buf) {
  const std::span<std::byte> dst(buf.data(), len);
  Status st;
  if (std::optional<image::MappedRead> run = d.map_read(off, len)) {
    const iovec one{dst.data(), dst.size()};
    Result<size_t> n = co_await run->file->readv(run->host_offset, {&one, 1});
    run.reset();  // its holds, now the read is done
    if (n && *n < len) std::memset(dst.data() + *n, 0, len - *n);  // past the host file's end
    if (!n) st = n.status();
  } else {
    st = co_await d.read(off, dst);
  }
  if (!st) {
    reply_error(to, st);
    co_return;
  }
  to.data(buf, len);
}

// `payload` points into `owner`, kept alive until the write is done.
Task<void> write_task(ReplyTo to, const ImageFile& file, uint64_t off, std::span<const std::byte> payload,
                      [[maybe_unused]] PooledBuffer owner) {
  Status st = co_await file.driver()->write(off, payload);
  if (!st) {
    reply_error(to, st);
    co_return;
  }
  file.note_write(off, payload.size());
  to.written(payload.size());
}

// The open behind a request's fuse_file_info, or nullptr for a read-only open.
OpenFile* open_file_of(const fuse_file_info* fi) {
  return fi ? reinterpret_cast<OpenFile*>(fi->fh) : nullptr;  // NOLINT: fh holds the pointer
}

// Zeroes what a truncating open skipped (fuse/open_file.h); a no-op for other opens.
// Gaps past the disk's end (shrunk since, through another open) are cut there.
Task<Status> zero_skipped(const ImageFile& file, OpenFile* open) {
  if (!open) co_return Status::ok();
  for (const OpenFile::Range& gap : open->take_gaps()) {
    const uint64_t size = file.driver()->size();
    if (gap.offset >= size) break;
    const uint64_t len = std::min(gap.length, size - gap.offset);
    QCOWFS_CO_TRY(co_await file.driver()->write_zeroes(gap.offset, len, true));
    file.note_write(gap.offset, len);
  }
  co_return Status::ok();
}

// FLUSH (close) and FSYNC: the ranges a truncating open skipped are zeroed,
// then everything written is made durable per the cache mode.
Task<void> flush_task(fuse_req_t req, const ImageFile& file, OpenFile* open) {
  Status st = co_await zero_skipped(file, open);
  if (st) st = co_await file.driver()->flush();
  if (!st) {
    reply_error(req, st);
    co_return;
  }
  fuse_reply_err(req, 0);
}

Task<void> zero_task(fuse_req_t req, const ImageFile& file, FallocatePlan plan) {
  bool unmap = plan.action == FallocatePlan::Action::zero_unmap;
  Status st = co_await file.driver()->write_zeroes(plan.offset, plan.length, unmap);
  if (!st) {
    reply_error(req, st);
    co_return;
  }
  file.note_write(plan.offset, plan.length);
  fuse_reply_err(req, 0);
}

// The first offset at or after off that is data (want_data) or a hole.
Task<Result<uint64_t>> seek_extent(image::BlockDriver& d, uint64_t off, uint64_t size, bool want_data) {
  while (off < size) {
    auto st = co_await d.block_status(off, size - off);
    if (!st) co_return st.status();
    if (st->data == want_data) co_return off;
    if (st->length == 0) co_return Status::errorf(EIO, "empty block status at offset {}", off);
    off += st->length;
  }
  if (want_data) co_return Status::error(ENXIO, "no data after the offset");
  co_return size;  // the end of the disk counts as a hole
}

Task<void> lseek_task(fuse_req_t req, image::BlockDriver& d, uint64_t off, uint64_t size, bool want_data) {
  auto found = co_await seek_extent(d, off, size, want_data);
  if (!found) {
    reply_error(req, found.status());
    co_return;
  }
  fuse_reply_lseek(req, static_cast<off_t>(*found));
}

// Replies to an OPEN; a writer's open gets its OpenFile (freed in op_release).
// A catalogue image's user (counted before) is given back when the reply
// fails (-ENOENT: interrupted), since no RELEASE follows.
void reply_open(fuse_req_t req, ImageFile& file, fuse_file_info& fi) {
  const bool for_writing = (fi.flags & O_ACCMODE) != O_RDONLY;
  std::unique_ptr<OpenFile> open;
  if (for_writing) open = std::make_unique<OpenFile>((fi.flags & O_TRUNC) != 0);
  fi.fh = reinterpret_cast<uint64_t>(open.get());  // NOLINT: fh holds the pointer
  if (fuse_reply_open(req, &fi) == 0) (void)open.release();
  else if (file.counts_users()) file.release();
}

// The first open of a snapshot, or of a catalogue image (acquire(): counted
// until its RELEASE). A catalogue image that cannot be opened (corrupt, a
// missing backing file, a wrong key, locked by another user) fails only this
// open, with EIO; the catalogue's opener has logged why.
Task<void> open_task(fuse_req_t req, ImageFile& file, fuse_file_info fi) {
  Status st;  // (no co_await in a conditional expression: GCC 12 miscompiles its temporaries)
  if (file.counts_users()) st = co_await file.acquire();
  else st = co_await file.ensure_open();
  if (!st) {
    reply_error(req, st);
    co_return;
  }
  reply_open(req, file, fi);
}

// Grows or shrinks the disk. Drivers refuse to shrink over data (EINVAL,
// image/shrink.h), so no size change drops data; O_TRUNC and the size
// changes of a truncating open that need no growth never get here (see
// op_open, op_setattr). `open`: the open it came through, or nullptr.
Task<void> resize_task(fuse_req_t req, const Node& node, uint64_t new_size, OpenFile* open) {
  ImageFile& file = *node.file;
  const bool counted = file.counts_users();  // a catalogue image: held for the resize
  Status st;
  if (counted) st = co_await file.acquire();
  else st = co_await file.ensure_open();
  const bool held = counted && st.is_ok();
  if (st && new_size != file.size()) st = co_await file.driver()->truncate(new_size);
  if (held) file.release();
  if (!st) {
    reply_error(req, st);
    co_return;
  }
  if (open) open->set_size(new_size);  // grown: the truncating writer's file ends there
  reply_attr(req, fs_of(req), node);
}

// Re-reads a dynamic directory (partitions/, a catalogue's directory) before
// it is listed; a failed re-read keeps the previous entries and is only logged.
Task<void> refresh_task(fuse_req_t req, DynamicDirectory& d, fuse_ino_t ino, fuse_file_info fi) {
  Status st = co_await d.refresh(ino);
  if (!st) log::warn("re-reading {}: {}", d.source(), st.to_string());
  fuse_reply_open(req, &fi);
}

// ---- callbacks ----

void op_init(void*, fuse_conn_info* conn) {
  conn->max_write = kMaxWrite;
  conn->max_background = kMaxBackground;
  conn->congestion_threshold = kCongestionThreshold;
  conn->want &= ~unsigned{FUSE_CAP_SPLICE_READ | FUSE_CAP_SPLICE_WRITE | FUSE_CAP_SPLICE_MOVE | FUSE_CAP_WRITEBACK_CACHE};
  // ATOMIC_O_TRUNC: O_TRUNC reaches us as an open flag (which op_open
  // ignores, as a block device does) instead of a truncate to 0.
  for (unsigned cap : {unsigned{FUSE_CAP_ASYNC_READ}, unsigned{FUSE_CAP_ASYNC_DIO}, unsigned{FUSE_CAP_ATOMIC_O_TRUNC}})
    if (conn->capable & cap) conn->want |= cap;
  log::debug("FUSE protocol {}.{}: max_write {}, max_background {}", conn->proto_major, conn->proto_minor,
             conn->max_write, conn->max_background);
}

// Answers a lookup from the table as it is now. An ENOENT error reply leaves
// the kernel no cached negative entry; entries of a dynamic directory get no
// entry timeout, so the next path walk asks again (after a refresh it may get
// a new inode for the same name).
void reply_lookup(fuse_req_t req, fuse_ino_t parent, const char* name, bool dynamic) {
  const Filesystem& fs = fs_of(req);
  const Node* node = fs.table().lookup(parent, name);
  if (!node) {
    fuse_reply_err(req, ENOENT);
    return;
  }
  fuse_entry_param e = {};
  e.ino = node->ino;
  e.generation = 1;
  e.attr = fs.table().attributes(*node, fs.attr_context());
  e.attr_timeout = kAttrTimeout;
  e.entry_timeout = dynamic ? 0.0 : kEntryTimeout;
  fuse_reply_entry(req, &e);
}

// A lookup in a dynamic directory whose source may have changed since it was
// read (partitions/ after a new partition table, a catalogue's source
// directory): bring the name up to date, then answer. A failed re-read keeps
// the previous entries and is only logged.
Task<void> refreshed_lookup_task(fuse_req_t req, DynamicDirectory& d, fuse_ino_t parent, std::string name) {
  Status st = co_await d.refresh_name(parent, name);
  if (!st) log::warn("re-reading {}: {}", d.source(), st.to_string());
  reply_lookup(req, parent, name.c_str(), true);
}

void op_lookup(fuse_req_t req, fuse_ino_t parent, const char* name) {
  DynamicDirectory* d = fs_of(req).table().dynamic_for(parent);
  if (d && d->needs_refresh(parent)) {
    EventLoop::current()->spawn_request(refreshed_lookup_task(req, *d, parent, name));
    return;
  }
  reply_lookup(req, parent, name, d != nullptr);
}

void op_forget(fuse_req_t req, fuse_ino_t, uint64_t) { fuse_reply_none(req); }

void op_getattr(fuse_req_t req, fuse_ino_t ino, fuse_file_info*) {
  const Filesystem& fs = fs_of(req);
  const Node* node = fs.table().get(ino);
  if (!node) {
    fuse_reply_err(req, ENOENT);
    return;
  }
  reply_attr(req, fs, *node);
}

// The chmod/chown part of a setattr (ok when it has none).
Status change_access(fuse_req_t req, Filesystem& fs, const Node& node, const struct stat& attr, int to_set) {
  if (!(to_set & (FUSE_SET_ATTR_MODE | FUSE_SET_ATTR_UID | FUSE_SET_ATTR_GID))) return Status::ok();
  AccessChange c;
  if (to_set & FUSE_SET_ATTR_MODE) c.mode = attr.st_mode;
  if (to_set & FUSE_SET_ATTR_UID) c.uid = attr.st_uid;
  if (to_set & FUSE_SET_ATTR_GID) c.gid = attr.st_gid;
  return fs.change_access(node.ino, fuse_req_ctx(req)->uid, c);
}

// A size change through an open (ftruncate: the kernel passes its handle)
// that truncates the writer's file to 0, or one by an open that did so before
// (or opened with O_TRUNC) that needs no growth: the disk keeps its size and
// data, as for O_TRUNC, and the open zeroes what it skipped on flush
// (fuse/open_file.h). qemu-img convert without -n sizes its target so.
bool truncating_resize(const ImageFile& file, OpenFile* open, uint64_t new_size) {
  if (!open || new_size > file.size()) return false;
  if (new_size == 0) {
    open->truncate_to_zero();
    return true;
  }
  if (!open->truncating()) return false;
  open->set_size(new_size);
  return true;
}

void op_setattr(fuse_req_t req, fuse_ino_t ino, struct stat* attr, int to_set, fuse_file_info* fi) {
  Filesystem& fs = fs_of(req);
  const Node* node = fs.table().get(ino);
  if (!node) {
    fuse_reply_err(req, ENOENT);
    return;
  }
  if (Status st = change_access(req, fs, *node, *attr, to_set); !st) {
    reply_error(req, st);
    return;
  }
  if (!(to_set & FUSE_SET_ATTR_SIZE)) {  // times: fixed; report the attributes as they are now
    reply_attr(req, fs, *node);
    return;
  }
  if (node->kind != NodeKind::image) {
    fuse_reply_err(req, EISDIR);
    return;
  }
  if (!node->file->writable()) {
    fuse_reply_err(req, EROFS);
    return;
  }
  const auto new_size = static_cast<uint64_t>(attr->st_size);
  OpenFile* open = open_file_of(fi);
  log::debug("setattr size {} of inode {} {}", new_size, ino, fi ? "through an open" : "by path");
  if (node->file->driver() && truncating_resize(*node->file, open, new_size)) {
    reply_attr(req, fs, *node);
    return;
  }
  EventLoop::current()->spawn_request(resize_task(req, *node, new_size, open));
}

// O_TRUNC (in fi->flags, see op_init) is ignored: the view is a disk, and like
// a block device it keeps its size and data whatever the open asks.
void op_open(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  const Node* node = image_node_or_reply(req, ino);
  if (!node) return;
  const bool for_writing = (fi->flags & O_ACCMODE) != O_RDONLY;
  if (for_writing && !node->file->writable()) {
    fuse_reply_err(req, EROFS);
    return;
  }
  if (int32_t backing = node->file->backing_id(); backing >= 0) {
    passthrough::reply_open(req, backing);
    return;
  }
  fi->direct_io = 1;  // no page cache on top of the host's: O_DIRECT opens work too
  fi->keep_cache = 0;
  fi->noflush = !for_writing;  // flush() makes writes durable only for writers
  const bool ready = node->file->counts_users() ? node->file->try_acquire() : node->file->driver() != nullptr;
  if (ready) {
    reply_open(req, *node->file, *fi);
    return;
  }
  EventLoop::current()->spawn_request(open_task(req, *node->file, *fi));
}

// READ: a task reads the image into a loop buffer (a ring request's own
// payload buffer) and replies with it.
void start_read(ReplyTo to, const Filesystem& fs, fuse_ino_t ino, size_t size, uint64_t off) {
  auto [file, err] = io_file(fs, ino, false);
  if (!file) {
    to.error(err);
    return;
  }
  image::BlockDriver* d = file->driver();
  const uint64_t len = readable_bytes(off, size, d->size());
  if (len == 0) {
    PooledBuffer none;
    to.data(none, 0);
    return;
  }
  EventLoop* loop = EventLoop::current();
  loop->spawn_request(read_task(to, *d, off, len, loop->read_buffer(len)), len);
}

// WRITE of size bytes at buf (the request's payload); `open` is the writer's
// open (null for a read-only open, which the kernel never writes through).
void start_write(ReplyTo to, const Filesystem& fs, fuse_ino_t ino, const char* buf, size_t size, uint64_t off,
                 OpenFile* open) {
  auto [file, err] = io_file(fs, ino, true);
  if (!file) {
    to.error(err);
    return;
  }
  image::BlockDriver* d = file->driver();
  auto n = writable_bytes(off, size, d->size());  // short across the end
  if (!n) {
    reply_error(to, n.status());
    return;
  }
  if (*n == 0) {
    to.written(0);
    return;
  }
  if (open) open->note_written(off, *n);
  EventLoop* loop = EventLoop::current();
  std::span<const std::byte> payload(reinterpret_cast<const std::byte*>(buf), static_cast<size_t>(*n));
  PooledBuffer owner = loop->hold_write_payload(payload);
  const uint64_t bytes = payload.size();
  loop->spawn_request(write_task(to, *file, off, payload, std::move(owner)), bytes);
}

void op_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, fuse_file_info*) {
  start_read(ReplyTo(req), fs_of(req), ino, size, static_cast<uint64_t>(off));
}

void op_write(fuse_req_t req, fuse_ino_t ino, const char* buf, size_t size, off_t off, fuse_file_info* fi) {
  start_write(ReplyTo(req), fs_of(req), ino, buf, size, static_cast<uint64_t>(off), open_file_of(fi));
}

void op_flush(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  ImageFile* file = opened_file_or_reply(req, ino);
  if (!file) return;
  OpenFile* open = open_file_of(fi);
  if (!open || file->driver()->read_only()) {
    fuse_reply_err(req, 0);
    return;
  }
  EventLoop::current()->spawn_request(flush_task(req, *file, open));
}

void op_fsync(fuse_req_t req, fuse_ino_t ino, int, fuse_file_info* fi) {
  ImageFile* file = opened_file_or_reply(req, ino);
  if (!file) return;
  if (file->driver()->read_only()) {
    fuse_reply_err(req, 0);
    return;
  }
  EventLoop::current()->spawn_request(flush_task(req, *file, open_file_of(fi)));
}

void op_release(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  std::unique_ptr<OpenFile> open(open_file_of(fi));
  if (open && open->overflowed())
    log::info(
        "an open with O_TRUNC (or truncated to 0) wrote too scattered to track: the ranges it skipped were "
        "left as they were");
  const Node* node = fs_of(req).table().get(ino);
  if (node && node->file && node->file->counts_users()) node->file->release();
  fuse_reply_err(req, 0);
}

void op_opendir(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  const Node* node = fs_of(req).table().get(ino);
  if (!node) {
    fuse_reply_err(req, ENOENT);
    return;
  }
  if (node->kind != NodeKind::directory) {
    fuse_reply_err(req, ENOTDIR);
    return;
  }
  if (DynamicDirectory* d = fs_of(req).table().dynamic_for(ino)) {
    EventLoop::current()->spawn_request(refresh_task(req, *d, ino, *fi));
    return;
  }
  fuse_reply_open(req, fi);
}

// Entry i of a directory listing: ".", "..", then the children.
bool dir_entry(const InodeTable& table, const Node& dir, const std::vector<Ino>& children, size_t i,
               const char*& name, struct stat& st) {
  st = {};
  if (i < 2) {
    name = i == 0 ? "." : "..";
    st.st_ino = i == 0 ? dir.ino : dir.parent;
    st.st_mode = S_IFDIR;
    return true;
  }
  if (i - 2 >= children.size()) return false;
  const Node* child = table.get(children[i - 2]);
  name = child->name.c_str();
  st.st_ino = child->ino;
  st.st_mode = child->kind == NodeKind::directory ? S_IFDIR : S_IFREG;
  return true;
}

void op_readdir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, fuse_file_info*) {
  const InodeTable& table = fs_of(req).table();
  const Node* dir = table.get(ino);
  if (!dir || dir->kind != NodeKind::directory) {
    fuse_reply_err(req, dir ? ENOTDIR : ENOENT);
    return;
  }
  std::vector<char> buf(size);
  size_t used = 0;
  const char* name = nullptr;
  struct stat st;
  const std::vector<Ino> children = table.children(*dir);
  for (size_t i = static_cast<size_t>(std::max<off_t>(off, 0)); dir_entry(table, *dir, children, i, name, st); ++i) {
    size_t need = fuse_add_direntry(req, buf.data() + used, size - used, name, &st, static_cast<off_t>(i + 1));
    if (need > size - used) break;
    used += need;
  }
  fuse_reply_buf(req, buf.data(), used);
}

void op_releasedir(fuse_req_t req, fuse_ino_t, fuse_file_info*) { fuse_reply_err(req, 0); }

void op_statfs(fuse_req_t req, fuse_ino_t) {
  const InodeTable& table = fs_of(req).table();
  uint64_t bytes = 0;
  for (const ImageFile* f : table.image_files()) bytes += f->size();
  struct statvfs st = {};
  st.f_bsize = 4096;
  st.f_frsize = 4096;
  st.f_blocks = div_round_up(bytes, 4096);
  st.f_files = table.node_count();
  st.f_namemax = 255;
  fuse_reply_statfs(req, &st);
}

void op_fallocate(fuse_req_t req, fuse_ino_t ino, int mode, off_t off, off_t len, fuse_file_info* fi) {
  ImageFile* file = writable_file_or_reply(req, ino);
  if (!file) return;
  image::BlockDriver* d = file->driver();
  auto plan = plan_fallocate(mode, static_cast<uint64_t>(off), static_cast<uint64_t>(len), d->size());
  if (!plan) {
    reply_error(req, plan.status());
    return;
  }
  if (plan->action == FallocatePlan::Action::nothing || plan->length == 0) {
    fuse_reply_err(req, 0);
    return;
  }
  if (OpenFile* open = open_file_of(fi)) open->note_written(plan->offset, plan->length);
  EventLoop::current()->spawn_request(zero_task(req, *file, *plan));
}

void op_lseek(fuse_req_t req, fuse_ino_t ino, off_t off, int whence, fuse_file_info*) {
  image::BlockDriver* d = driver_or_reply(req, ino);
  if (!d) return;
  if (whence != SEEK_DATA && whence != SEEK_HOLE) {
    fuse_reply_err(req, EINVAL);
    return;
  }
  const uint64_t size = d->size();
  if (off < 0 || static_cast<uint64_t>(off) >= size) {
    fuse_reply_err(req, ENXIO);
    return;
  }
  EventLoop::current()->spawn_request(lseek_task(req, *d, static_cast<uint64_t>(off), size, whence == SEEK_DATA));
}

fuse_lowlevel_ops make_operations() {
  fuse_lowlevel_ops ops = {};
  ops.init = op_init;
  ops.lookup = op_lookup;
  ops.forget = op_forget;
  ops.getattr = op_getattr;
  ops.setattr = op_setattr;
  ops.open = op_open;
  ops.read = op_read;
  ops.write = op_write;
  ops.flush = op_flush;
  ops.release = op_release;
  ops.fsync = op_fsync;
  ops.opendir = op_opendir;
  ops.readdir = op_readdir;
  ops.releasedir = op_releasedir;
  ops.statfs = op_statfs;
  ops.fallocate = op_fallocate;
  ops.lseek = op_lseek;
  return ops;
}

}  // namespace

Filesystem::Filesystem(InodeTable table, AttrContext initial, Ino view, uid_t mounter)
    : table_(std::move(table)),
      ctx_(initial),
      access_(initial.view),
      view_(view),
      mounter_(mounter) {}

AttrContext Filesystem::attr_context() const {
  AttrContext ctx = ctx_;
  ctx.view = access_.get();
  return ctx;
}

Status Filesystem::change_access(Ino ino, uid_t caller, const AccessChange& change) {
  const Node* node = ino == view_ ? nullptr : table_.get(ino);
  if (ino != view_ && !(node && node->own_access && node->access))
    return Status::error(EPERM, "only the raw view's owner and mode can change; the other files follow it");
  if (!may_change_access(caller, mounter_))
    return Status::errorf(EPERM, "uid {} may not change the view's owner or mode (only the mounting user and root)",
                          caller);
  if (node) node->access->change(change);  // a catalogue's view
  else access_.change(change);
  return Status::ok();
}

// READ and WRITE, the requests of all I/O, skip libfuse: its request
// allocation, session-lock rounds and reply path were ~760 of the ~6400
// instructions the daemon spends on a 4 KiB write (callgrind; bench/RESULTS.md).
// The arguments are decoded as libfuse decodes them (protocol 7.9 and later,
// which every kernel with io_uring or FUSE passthrough speaks). INTERRUPT is
// dropped: no request of ours acts on one, and libfuse, not finding a request
// it never saw, would keep it and answer EAGAIN at the next request (the
// kernel then sends it again). Messages whose lengths do not add up are left
// to libfuse, which answers them as it always has.
bool Filesystem::serve_direct(std::span<std::byte> message) const {
  fuse_in_header in;
  if (message.size() < sizeof in) return false;
  std::memcpy(&in, message.data(), sizeof in);
  if (in.len != message.size() || in.total_extlen != 0) return false;  // extensions: libfuse's to skip
  const std::byte* args = message.data() + sizeof in;
  const size_t arg_bytes = message.size() - sizeof in;
  switch (in.opcode) {
    case FUSE_READ: {
      fuse_read_in arg;
      if (arg_bytes < sizeof arg) return false;
      std::memcpy(&arg, args, sizeof arg);
      start_read(ReplyTo(in.unique), *this, in.nodeid, arg.size, arg.offset);
      return true;
    }
    case FUSE_WRITE: {
      fuse_write_in arg;
      if (arg_bytes < sizeof arg) return false;
      std::memcpy(&arg, args, sizeof arg);
      if (arg_bytes - sizeof arg < arg.size) return false;
      const char* payload = reinterpret_cast<const char*>(args + sizeof arg);
      start_write(ReplyTo(in.unique), *this, in.nodeid, payload, arg.size, arg.offset,
                  reinterpret_cast<OpenFile*>(arg.fh));  // NOLINT: fh holds the pointer (reply_open)
      return true;
    }
    case FUSE_INTERRUPT:
      return true;
    default:
      return false;
  }
}

const fuse_lowlevel_ops& Filesystem::operations() {
  static const fuse_lowlevel_ops ops = make_operations();
  return ops;
}

}  // namespace qcowfs::fuse
