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
  iovec vec[2] = {};  // iovcnt of them
  std::optional<PooledBuffer> lent;  // a READ reply's data, not copied
  std::byte bytes[kQueuedReplyMax];
};

ReplyQueue::ReplyQueue() = default;
ReplyQueue::~ReplyQueue() = default;

std::optional<ssize_t> ReplyQueue::queue(io::Engine& engine, int fd, const iovec* iov, int count,
                                         PooledBuffer* lent) {
  if (!queuing_ || !engine.submits_inline() || count < 1 || iov[0].iov_len < sizeof(fuse_out_header))
    return std::nullopt;
  size_t total = 0;
  for (int i = 0; i < count; ++i) total += iov[i].iov_len;
  fuse_out_header out;
  std::memcpy(&out, iov[0].iov_base, sizeof out);
  if (out.unique == 0) return std::nullopt;
  if (total > kQueuedReplyMax) return std::nullopt;
  const bool lending = lent && count == 2 && iov[0].iov_len == sizeof out && iov[1].iov_len > 0 &&
                       iov[1].iov_base == lent->data();
  std::unique_ptr<Reply> reply = take_reply();
  if (lending) {
    std::memcpy(reply->bytes, &out, sizeof out);
    reply->vec[0] = {reply->bytes, sizeof out};
    reply->vec[1] = iov[1];
    reply->iovcnt = 2;
    reply->lent.emplace(std::move(*lent));
  } else {
    size_t at = 0;
    for (int i = 0; i < count; ++i) {
      if (iov[i].iov_len) std::memcpy(reply->bytes + at, iov[i].iov_base, iov[i].iov_len);
      at += iov[i].iov_len;
    }
    reply->vec[0] = {reply->bytes, total};
    reply->iovcnt = 1;
  }
  enqueue(engine, fd, std::move(reply));
  return static_cast<ssize_t>(total);
}

std::unique_ptr<ReplyQueue::Reply> ReplyQueue::take_reply() {
  if (idle_.empty()) return std::make_unique<Reply>();
  std::unique_ptr<Reply> reply = std::move(idle_.back());
  idle_.pop_back();
  return reply;
}

void ReplyQueue::enqueue(io::Engine& engine, int fd, std::unique_ptr<Reply> reply) {
  reply->queue = this;
  reply->op = io::IoRequest::Op::writev;
  reply->fd = fd;
  reply->offset = 0;
  reply->iov = reply->vec;
  reply->result = 0;
  reply->on_done = &ReplyQueue::on_done;
  ++pending_;
  engine.enqueue(reply.release());
}

void ReplyQueue::on_done(io::IoRequest* req) {
  std::unique_ptr<Reply> reply(static_cast<Reply*>(req));
  ReplyQueue& q = *reply->queue;
  --q.pending_;
  if (reply->result < 0) q.failed(*reply);
  reply->lent.reset();  // back to its loop's pool
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
  if (::writev(reply.fd, reply.vec, static_cast<int>(reply.iovcnt)) < 0 && errno != ENOENT && errno != ENODEV)
    log::warn("{}", Status::from_errno(errno, "writing a FUSE reply").to_string());
}

}  // namespace qcowfs::fuse
