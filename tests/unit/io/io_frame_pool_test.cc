// FramePool (io/frame_pool.h): per-thread recycling of coroutine frames.
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "io/frame_pool.h"
#include "io/run_sync.h"
#include "io/task.h"

namespace qcowfs::detail {
namespace {

// Each test runs on a fresh thread so that the lists start empty.
template <typename F>
void on_fresh_thread(F f) {
  std::thread t(f);
  t.join();
}

TEST(FramePool, AFreedFrameIsReusedForTheSameSizeClass) {
  on_fresh_thread([] {
    void* a = FramePool::allocate(200);
    FramePool::deallocate(a, 200);
    void* b = FramePool::allocate(230);  // same 64-byte class as 200
    if (QCOWFS_FRAME_POOL) {
      EXPECT_EQ(a, b);
    } else {
      EXPECT_EQ(FramePool::cached(), 0u);  // sanitizer builds: plain new/delete
    }
    FramePool::deallocate(b, 230);
  });
}

TEST(FramePool, ListsAreBoundedAndLargeFramesAreNotKept) {
  on_fresh_thread([] {
    std::vector<void*> frames;
    for (int i = 0; i < 300; ++i) frames.push_back(FramePool::allocate(100));
    for (void* p : frames) FramePool::deallocate(p, 100);
    void* big = FramePool::allocate(4096);
    FramePool::deallocate(big, 4096);
    EXPECT_EQ(FramePool::cached(), QCOWFS_FRAME_POOL ? size_t{FramePool::kMaxPerClass} : 0u);
  });
}

TEST(FramePool, AFrameFreedOnAnotherThreadJoinsThatThreadsList) {
  void* p = FramePool::allocate(300);
  on_fresh_thread([p] {
    FramePool::deallocate(p, 300);
    EXPECT_EQ(FramePool::cached(), QCOWFS_FRAME_POOL ? 1u : 0u);
  });
}

Task<int> leaf(int v) { co_return v + 1; }
Task<int> chain(int depth) {
  int sum = 0;
  for (int i = 0; i < depth; ++i) sum += co_await leaf(i);
  co_return sum;
}

TEST(FramePool, TaskFramesComeFromThePool) {
  on_fresh_thread([] {
    auto engine = io::make_engine(io::EngineKind::threads);
    ASSERT_TRUE(engine.is_ok());
    EXPECT_EQ(io::run_sync(**engine, chain(1000)), 1000 * 1001 / 2);
    // The leaf frames went back to this thread's lists; one frame serves them all.
    if (QCOWFS_FRAME_POOL) {
      EXPECT_GE(FramePool::cached(), 1u);
      EXPECT_LE(FramePool::cached(), 8u);
    }
  });
}

}  // namespace
}  // namespace qcowfs::detail
