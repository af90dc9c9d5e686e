// MemFile tests: plain I/O, fault injection reaching callers with the right
// errno, short I/O, the ENOSPC size limit, alignment accounting, holes, and
// crash images built from unflushed writes.
#include <algorithm>
#include <set>
#include <thread>

#include <gtest/gtest.h>

#include "io/buffer.h"
#include "io/engine.h"
#include "io/mem_file.h"
#include "io/run_sync.h"
#include "unit/io/io_test_util.h"

namespace qcowfs::io {
namespace {

using testing::pattern;

// MemFile completes synchronously.
using testing::run_now;

std::vector<std::byte> bytes(std::initializer_list<int> v) {
  std::vector<std::byte> out;
  for (int x : v) out.push_back(static_cast<std::byte>(x));
  return out;
}

// A caller in the style of image code: read a header, then write a record.
Task<Status> read_then_write(HostFile& f) {
  std::vector<std::byte> header(16);
  auto n = co_await f.read(0, header);
  if (!n) co_return n.status().with_context("reading header");
  std::vector<std::byte> rec(8, std::byte{7});
  QCOWFS_CO_TRY(co_await f.write(100, rec));
  co_return co_await f.flush();
}

TEST(MemFile, WriteReadRoundTripAndEof) {
  MemFile f;
  EXPECT_EQ(f.size(), 0u);
  auto data = pattern(10000, 1);
  ASSERT_TRUE(run_now(f.write(5, data)).is_ok());
  EXPECT_EQ(f.size(), 10005u);
  std::vector<std::byte> buf(20000, std::byte{0xAA});
  auto n = run_now(f.read(0, buf));
  ASSERT_TRUE(n.is_ok());
  EXPECT_EQ(*n, 10005u);
  EXPECT_EQ(buf[0], std::byte{0});
  EXPECT_TRUE(std::equal(data.begin(), data.end(), buf.begin() + 5));
  EXPECT_EQ(buf[10005], std::byte{0xAA});
  auto past = run_now(f.read(50000, buf));
  ASSERT_TRUE(past.is_ok());
  EXPECT_EQ(*past, 0u);
}

TEST(MemFile, VectoredIo) {
  MemFile f({}, std::vector<std::byte>(100));
  auto a = bytes({1, 2, 3}), b = bytes({4, 5});
  iovec w[] = {{a.data(), a.size()}, {b.data(), b.size()}};
  ASSERT_TRUE(run_now(f.writev(10, w)).is_ok());
  std::vector<std::byte> x(1), y(4);
  iovec r[] = {{x.data(), 1}, {y.data(), 4}};
  auto n = run_now(f.readv(10, r));
  ASSERT_TRUE(n.is_ok());
  EXPECT_EQ(*n, 5u);
  EXPECT_EQ(x, bytes({1}));
  EXPECT_EQ(y, bytes({2, 3, 4, 5}));
}

TEST(MemFile, WorksUnderRunSyncOnBothEngines) {
  for (EngineKind k : {EngineKind::io_uring, EngineKind::threads}) {
    auto e = make_engine(k);
    ASSERT_TRUE(e.is_ok());
    MemFile f({}, std::vector<std::byte>(64));
    EXPECT_TRUE(run_sync(**e, read_then_write(f)).is_ok());
    EXPECT_EQ(f.content()[100], std::byte{7});
  }
}

TEST(MemFile, NthWriteFailsWithInjectedErrnoAndChangesNothing) {
  MemFile f({}, std::vector<std::byte>(64));
  f.fail_nth(OpKind::write, 2, EIO);
  auto one = bytes({1});
  EXPECT_TRUE(run_now(f.write(0, one)).is_ok());
  Status st = run_now(f.write(1, one));
  EXPECT_EQ(st.code(), EIO);
  EXPECT_NE(st.message().find("injected"), std::string::npos);
  EXPECT_EQ(f.content()[1], std::byte{0});
  EXPECT_TRUE(run_now(f.write(2, one)).is_ok()) << "a one-shot fault must not fire twice";
  EXPECT_EQ(f.counters().writes, 3u);
}

TEST(MemFile, FaultReachesCallerWithTheRightErrno) {
  struct Case {
    OpKind kind;
    uint64_t nth;
    int err;
  };
  for (Case c : {Case{OpKind::read, 1, EIO}, Case{OpKind::write, 1, ENOSPC}, Case{OpKind::flush, 1, EDQUOT},
                 Case{OpKind::any, 3, ENODEV}}) {
    MemFile f({}, std::vector<std::byte>(64));
    f.fail_nth(c.kind, c.nth, c.err);
    Status st = run_now(read_then_write(f));
    EXPECT_EQ(st.code(), c.err) << st.to_string();
  }
}

TEST(MemFile, AnyKindCountsEveryOperation) {
  MemFile f({}, std::vector<std::byte>(64));
  f.fail_nth(OpKind::any, 4, EROFS);
  std::vector<std::byte> b(4);
  EXPECT_TRUE(run_now(f.read(0, b)).is_ok());
  EXPECT_TRUE(run_now(f.flush()).is_ok());
  EXPECT_TRUE(run_now(f.discard(0, 4)).is_ok());
  EXPECT_EQ(run_now(f.write_zeroes(0, 4)).code(), EROFS);
  auto c = f.counters();
  EXPECT_EQ(c.total(), 4u);
  EXPECT_EQ(c.write_zeroes, 1u);
}

TEST(MemFile, FailFromIsADeadDiskUntilCleared) {
  MemFile f({}, std::vector<std::byte>(64));
  f.fail_from(OpKind::read, 2, EIO);
  std::vector<std::byte> b(4);
  EXPECT_TRUE(run_now(f.read(0, b)).is_ok());
  for (int i = 0; i < 5; ++i) EXPECT_EQ(run_now(f.read(0, b)).status().code(), EIO);
  EXPECT_TRUE(run_now(f.write(0, b)).is_ok()) << "other kinds keep working";
  f.clear_faults();
  EXPECT_TRUE(run_now(f.read(0, b)).is_ok());
}

TEST(MemFile, ShortReadOnce) {
  MemFile f({}, pattern(100, 3));
  f.short_once(OpKind::read, 10);
  std::vector<std::byte> b(50);
  auto n = run_now(f.read(0, b));
  ASSERT_TRUE(n.is_ok());
  EXPECT_EQ(*n, 10u);
  n = run_now(f.read(0, b));
  ASSERT_TRUE(n.is_ok());
  EXPECT_EQ(*n, 50u);
}

TEST(MemFile, ShortWriteIsTornAndFails) {
  MemFile f({}, std::vector<std::byte>(100));
  f.short_once(OpKind::write, 3, ENOSPC);
  auto data = bytes({1, 2, 3, 4, 5, 6});
  Status st = run_now(f.write(10, data));
  EXPECT_EQ(st.code(), ENOSPC);
  auto c = f.content();
  EXPECT_EQ(std::vector<std::byte>(c.begin() + 10, c.begin() + 16), bytes({1, 2, 3, 0, 0, 0}));
  EXPECT_TRUE(run_now(f.write(10, data)).is_ok());
}

TEST(MemFile, SizeLimitGivesEnospcAndStoresNothing) {
  MemFile f({}, std::vector<std::byte>(100));
  f.set_size_limit(150);
  std::vector<std::byte> d(40, std::byte{1});
  EXPECT_TRUE(run_now(f.write(100, d)).is_ok());  // grows to 140
  Status st = run_now(f.write(120, d));           // would reach 160
  EXPECT_EQ(st.code(), ENOSPC);
  EXPECT_EQ(f.size(), 140u);
  EXPECT_EQ(f.content()[139], std::byte{1});
  EXPECT_TRUE(run_now(f.write(0, d)).is_ok()) << "overwrites inside the file need no space";
  EXPECT_EQ(run_now(f.truncate(151)).code(), ENOSPC);
  EXPECT_EQ(run_now(f.write_zeroes(140, 11)).code(), ENOSPC);
  EXPECT_TRUE(run_now(f.write_zeroes(140, 10)).is_ok());
  EXPECT_EQ(f.size(), 150u);
}

TEST(MemFile, AlignmentIsReportedCountedAndOptionallyEnforced) {
  MemFileOptions o;
  o.offset_align = 4096;
  o.mem_align = 512;  // raised to the contract's minimum
  MemFile loose(o, std::vector<std::byte>(16384));
  EXPECT_EQ(loose.offset_align(), 4096u);
  EXPECT_EQ(loose.mem_align(), 4096u);
  std::vector<std::byte> b(100);
  EXPECT_TRUE(run_now(loose.read(1, b)).is_ok());
  EXPECT_EQ(loose.counters().unaligned, 1u);
  o.reject_unaligned = true;
  MemFile strict(o, std::vector<std::byte>(16384));
  EXPECT_EQ(run_now(strict.read(0, b)).status().code(), EINVAL);
  EXPECT_EQ(run_now(strict.write(4096, b)).code(), EINVAL);
  AlignedBuffer ok(4096, 4096);
  EXPECT_TRUE(run_now(strict.write(4096, ok.span())).is_ok());
  auto n = run_now(strict.read(8192, ok.span()));
  ASSERT_TRUE(n.is_ok());
  EXPECT_EQ(*n, 4096u);
}

TEST(MemFile, DiscardMakesHolesVisibleToSeek) {
  MemFile f({}, pattern(64 * 1024, 4));
  EXPECT_EQ(f.allocated_bytes(), 64u * 1024);
  ASSERT_TRUE(run_now(f.discard(10000, 20000)).is_ok());  // pages 3..6 become holes (12288..28672)
  EXPECT_EQ(f.allocated_bytes(), 48u * 1024);
  auto c = f.content();
  EXPECT_TRUE(std::all_of(c.begin() + 10000, c.begin() + 30000, [](std::byte x) { return x == std::byte{0}; }));
  EXPECT_NE(c[9999], std::byte{0});
  EXPECT_EQ(*run_now(f.seek_hole(0)), 12288u);
  EXPECT_EQ(*run_now(f.seek_data(12288)), 28672u);
  EXPECT_EQ(*run_now(f.seek_data(5)), 5u);
  EXPECT_EQ(*run_now(f.seek_hole(28672)), 64u * 1024);
  EXPECT_EQ(*run_now(f.seek_data(1 << 20)), 64u * 1024);
  ASSERT_TRUE(run_now(f.write(13000, bytes({9}))).is_ok());
  EXPECT_EQ(*run_now(f.seek_data(12288)), 12288u);
}

TEST(MemFile, ReadOnlyAndBlockDeviceRules) {
  MemFileOptions o;
  o.writable = false;
  MemFile ro(o, std::vector<std::byte>(10));
  EXPECT_EQ(run_now(ro.write(0, bytes({1}))).code(), EROFS);
  EXPECT_EQ(run_now(ro.discard(0, 1)).code(), EROFS);
  MemFileOptions d;
  d.block_device = true;
  MemFile dev(d, std::vector<std::byte>(10));
  EXPECT_TRUE(dev.is_block_device());
  EXPECT_EQ(run_now(dev.truncate(5)).code(), EINVAL);
}

TEST(MemFile, CrashImagesAreDurableStatePlusSubsetsOfUnflushedWrites) {
  MemFileOptions o;
  o.track_unflushed = true;
  MemFile f(o, std::vector<std::byte>(8));
  ASSERT_TRUE(run_now(f.write(0, bytes({1}))).is_ok());
  ASSERT_TRUE(run_now(f.flush()).is_ok());
  EXPECT_EQ(f.unflushed_count(), 0u);
  ASSERT_TRUE(run_now(f.write(1, bytes({2}))).is_ok());
  ASSERT_TRUE(run_now(f.write(1, bytes({3}))).is_ok());  // overlaps the previous write: order matters
  ASSERT_TRUE(run_now(f.write(9, bytes({4}))).is_ok());  // extends the file
  EXPECT_EQ(f.unflushed_count(), 3u);
  EXPECT_EQ(f.durable_content(), bytes({1, 0, 0, 0, 0, 0, 0, 0}));
  std::set<std::vector<std::byte>> seen;
  for (uint64_t seed = 0; seed < 200; ++seed) {
    auto img = f.crash_image(seed);
    EXPECT_EQ(img, f.crash_image(seed)) << "crash images must be reproducible from the seed";
    ASSERT_GE(img.size(), 8u);
    EXPECT_EQ(img[0], std::byte{1}) << "flushed data is never lost";
    EXPECT_TRUE(img[1] == std::byte{0} || img[1] == std::byte{2} || img[1] == std::byte{3});
    EXPECT_TRUE(img.size() == 8 || (img.size() == 10 && img[9] == std::byte{4}));
    seen.insert(img);
  }
  // Byte 1 in {0,2,3} x file extended or not: all six outcomes appear.
  EXPECT_EQ(seen.size(), 6u);
  ASSERT_TRUE(run_now(f.flush()).is_ok());
  EXPECT_EQ(f.crash_image(7), f.content());
}

TEST(MemFile, ConcurrentWritersFromThreads) {
  MemFile f({}, std::vector<std::byte>(4 * 1000));
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t) {
    ts.emplace_back([&, t] {
      for (int i = 0; i < 1000; ++i) {
        std::vector<std::byte> b(1, static_cast<std::byte>(t + 1));
        EXPECT_TRUE(run_now(f.write(static_cast<uint64_t>(i * 4 + t), b)).is_ok());
      }
    });
  }
  for (auto& t : ts) t.join();
  auto c = f.content();
  for (int i = 0; i < 4000; ++i) ASSERT_EQ(c[static_cast<size_t>(i)], static_cast<std::byte>(i % 4 + 1));
  EXPECT_EQ(f.counters().writes, 4000u);
}

}  // namespace
}  // namespace qcowfs::io
