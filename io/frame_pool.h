// FramePool: recycles coroutine frames on the thread that frees them.
// Every FUSE request allocates a handful of Task frames of a few hundred bytes;
// taking them from a per-thread free list instead of malloc keeps that off the
// request path. Frames are grouped in 64-byte size classes up to 2 KiB (larger
// ones go straight to operator new), each list keeps at most kMaxPerClass
// frames, and a thread's lists are released when it exits.
//
// Sanitizer builds use plain operator new/delete so ASan still sees every frame.
//
// Thread-safety: the lists are thread_local; a frame may be freed on another
// thread than the one that allocated it (it then joins that thread's list).
#pragma once

#include <cstddef>
#include <cstdint>
#include <new>

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define QCOWFS_FRAME_POOL 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(memory_sanitizer)
#define QCOWFS_FRAME_POOL 0
#endif
#endif
#ifndef QCOWFS_FRAME_POOL
#define QCOWFS_FRAME_POOL 1
#endif

namespace qcowfs::detail {

class FramePool {
 public:
  static constexpr size_t kGranule = 64;
  static constexpr size_t kClasses = 32;  // size classes 1..31: frames up to 1984 bytes
  static constexpr uint16_t kMaxPerClass = 256;

  static void* allocate(size_t n) {
    const size_t c = size_class(n);
    if (!QCOWFS_FRAME_POOL || c >= kClasses) return ::operator new(n);
    Lists& l = t_lists;
    if (Node* x = l.heads[c]) {
      l.heads[c] = x->next;
      --l.counts[c];
      return x;
    }
    return ::operator new(c * kGranule);
  }

  static void deallocate(void* p, size_t n) noexcept {
    const size_t c = size_class(n);
    Lists& l = t_lists;
    if (!QCOWFS_FRAME_POOL || c >= kClasses || l.exited || l.counts[c] >= kMaxPerClass) {
      ::operator delete(p);
      return;
    }
    if (!l.drain_registered) {
      l.drain_registered = true;
      t_drain.arm();  // constructs the thread's drainer, whose destructor frees the lists
    }
    l.heads[c] = new (p) Node{l.heads[c]};
    ++l.counts[c];
  }

  // Frames cached by the calling thread (for tests).
  static size_t cached() noexcept {
    size_t n = 0;
    for (uint16_t c : t_lists.counts) n += c;
    return n;
  }

 private:
  struct Node {
    Node* next;
  };
  // Trivially destructible, so it stays usable while other thread_locals are destroyed.
  struct Lists {
    Node* heads[kClasses];
    uint16_t counts[kClasses];
    bool drain_registered;
    bool exited;
  };
  struct Drain {
    void arm() noexcept {}
    ~Drain() {
      Lists& l = t_lists;
      l.exited = true;
      for (size_t c = 0; c < kClasses; ++c) {
        while (Node* x = l.heads[c]) {
          l.heads[c] = x->next;
          ::operator delete(x);
        }
        l.counts[c] = 0;
      }
    }
  };

  static size_t size_class(size_t n) noexcept { return (n + kGranule - 1) / kGranule; }

  static inline thread_local Lists t_lists{};
  static inline thread_local Drain t_drain;
};

}  // namespace qcowfs::detail
