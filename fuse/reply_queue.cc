#include "fuse/reply_queue.h"

#include <linux/fuse.h>

#include <cerrno>
#include <cstring>

#include "io/log.h"
#include "io/status.h"

namespace qcowfs::fuse {

namespace {
constexpr size_t kIdleReplies = 64;  // Reply objects kept for reuse
}  // namespace

struct ReplyQueue::Reply : io::IoRequest {
  ReplyQueue* queue = nullptr;
  iovec vec = {};
  std::byte bytes[kQueuedReplyMax];
};

ReplyQueue::ReplyQueue() = default;
ReplyQueue::~ReplyQueue() = default;

std::optional<ssize_t> ReplyQueue::queue(io::Engine& engine, int fd, const iovec* iov, int count) {
  if (!queuing_ || !engine.submits_inline() || count < 1 || iov[0].iov_len < sizeof(fuse_out_header))
    return std::nullopt;
  size_t total = 0;
  for (int i = 0; i < count; ++i) total += iov[i].iov_len;
  if (total > kQueuedReplyMax) return std::nullopt;
  fuse_out_header out;
  std::memcpy(&out, iov[0].iov_base, sizeof out);
  if (out.unique == 0) return std::nullopt;
  std::unique_ptr<Reply> reply;
  if (idle_.empty()) {
    reply = std::make_unique<Reply>();
  } else {
    reply = std::move(idle_.back());
    idle_.pop_back();
  }
  size_t at = 0;
  for (int i = 0; i < count; ++i) {
    if (iov[i].iov_len) std::memcpy(reply->bytes + at, iov[i].iov_base, iov[i].iov_len);
    at += iov[i].iov_len;
  }
  reply->queue = this;
  reply->vec = {reply->bytes, total};
  reply->op = io::IoRequest::Op::writev;
  reply->fd = fd;
  reply->offset = 0;
  reply->iov = &reply->vec;
  reply->iovcnt = 1;
  reply->result = 0;
  reply->on_done = &ReplyQueue::on_done;
  ++pending_;
  engine.enqueue(reply.release());
  return static_cast<ssize_t>(total);
}

void ReplyQueue::on_done(io::IoRequest* req) {
  std::unique_ptr<Reply> reply(static_cast<Reply*>(req));
  ReplyQueue& q = *reply->queue;
  --q.pending_;
  if (reply->result < 0) q.failed(*reply);
  if (q.idle_.size() < kIdleReplies) q.idle_.push_back(std::move(reply));
}

void ReplyQueue::failed(Reply& reply) {
  const int err = static_cast<int>(-reply.result);
  if (err == ENOENT || err == ENODEV) return;
  if (queuing_) {
    log::warn("{}: replies go by writev() from now on",
              Status::from_errno(err, "writing a FUSE reply through io_uring").to_string());
    queuing_ = false;
  }
  if (::writev(reply.fd, &reply.vec, 1) < 0 && errno != ENOENT && errno != ENODEV)
    log::warn("{}", Status::from_errno(errno, "writing a FUSE reply").to_string());
}

}  // namespace qcowfs::fuse
