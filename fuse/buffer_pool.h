// Buffer recycling for one event-loop thread. Every FUSE request needs a
// request buffer (up to max_write + headers) and every read a result buffer;
// allocating and faulting in a megabyte per request would cost more than the
// I/O, so each loop keeps a few idle buffers of each size for reuse.
//
// BufferPool holds buffers of one fixed size; SizedBufferPool holds
// power-of-two size classes from 4 KiB to kMaxPooledSize (larger requests are
// served unpooled). Both bound the memory they keep idle. Buffers of a
// megabyte and more come from io::AlignedBuffer::for_large_io(): huge-page
// backed, so a 1 MiB read or write reaches the disk as one DMA segment; each
// then occupies 2 MiB. PooledBuffer is the owner a request holds: it gives
// its buffer back to its loop's pools when dropped (EventLoop::recycle()).
//
// Thread-safety: none; a pool belongs to one event-loop thread (or is used
// under a lock: ReaderGroup's request buffers), and buffers are given back on
// the thread that took them (a request's coroutine resumes where it began).
#pragma once

#include <cstddef>
#include <vector>

#include "io/buffer.h"

namespace qcowfs::fuse {

class EventLoop;

class BufferPool {
 public:
  BufferPool(size_t buffer_size, size_t align, size_t max_idle);

  // An idle buffer or a new one (not zeroed: callers overwrite it).
  io::AlignedBuffer take();
  // Keeps buf for reuse unless enough are idle or it is the wrong shape.
  void give(io::AlignedBuffer buf);

  size_t buffer_size() const { return size_; }
  size_t idle_count() const { return idle_.size(); }

 private:
  size_t size_;
  size_t align_;
  size_t max_idle_;
  std::vector<io::AlignedBuffer> idle_;
};

class SizedBufferPool {
 public:
  static constexpr size_t kMinClass = 4096;
  static constexpr size_t kMaxPooledSize = size_t{1} << 20;
  // Idle memory kept in all classes together: enough for a queue depth of
  // 16 one-megabyte reads on one thread without returning memory to the system.
  static constexpr size_t kIdleBytes = size_t{16} << 20;

  explicit SizedBufferPool(size_t align);

  // A buffer of at least `size` bytes (its size() is the class size).
  io::AlignedBuffer take(size_t size);
  void give(io::AlignedBuffer buf);

  size_t idle_count() const;
  static size_t class_size(size_t size);

 private:
  size_t align_;
  size_t idle_bytes_ = 0;
  std::vector<BufferPool> classes_;  // kMinClass << i
};

// Returns a loop buffer to its loop's pools when dropped (on the loop thread).
class PooledBuffer {
 public:
  PooledBuffer(EventLoop* loop, io::AlignedBuffer buf) : loop_(loop), buf_(std::move(buf)) {}
  // Owns nothing: `borrowed` belongs to someone that keeps it alive (a ring entry).
  explicit PooledBuffer(std::byte* borrowed = nullptr) : loop_(nullptr), borrowed_(borrowed) {}
  PooledBuffer(PooledBuffer&&) = default;
  PooledBuffer& operator=(PooledBuffer&&) = delete;
  PooledBuffer(const PooledBuffer&) = delete;
  PooledBuffer& operator=(const PooledBuffer&) = delete;
  ~PooledBuffer();  // event_loop.cc
  std::byte* data() { return borrowed_ ? borrowed_ : buf_.data(); }

 private:
  EventLoop* loop_;
  io::AlignedBuffer buf_;
  std::byte* borrowed_ = nullptr;
};

}  // namespace qcowfs::fuse
