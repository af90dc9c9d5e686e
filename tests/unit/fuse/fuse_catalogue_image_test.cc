// ImageFile as a catalogue image (fuse/image_file.h): opened on the first
// acquire, counted, closed only when unused for the idle delay, reopened
// after; a failed open leaves it closed and is tried again.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>

#include "fuse/image_file.h"
#include "io/run_sync.h"
#include "unit/image/fake_driver.h"

namespace qcowfs::fuse {
namespace {

using fakes::FakeDriver;
using namespace std::chrono_literals;

struct Counts {
  int opens = 0;
  int idles = 0;
  bool fail = false;
};

std::unique_ptr<ImageFile> counted_image(Counts& c) {
  auto f = std::make_unique<ImageFile>(
      [&c]() -> Task<Result<std::unique_ptr<image::BlockDriver>>> {
        ++c.opens;
        if (c.fail) co_return Status::error(EIO, "corrupt");
        std::unique_ptr<image::BlockDriver> d = std::make_unique<FakeDriver>(8 << 20, false);
        co_return d;
      },
      true);
  f->set_on_idle([&c] { ++c.idles; });
  f->set_closed_attributes(4 << 20, 512);
  return f;
}

TEST(CatalogueImage, OpensOnFirstAcquireAndClosesOnlyWhenIdle) {
  Counts c;
  auto f = counted_image(c);
  auto engine = io::make_engine(io::EngineKind::threads);
  ASSERT_TRUE(engine);
  EXPECT_FALSE(f->is_open());
  EXPECT_EQ(f->size(), 4u << 20);  // from the header until opened
  EXPECT_FALSE(f->try_acquire());
  ASSERT_TRUE(io::run_sync(**engine, f->acquire()));
  EXPECT_TRUE(f->try_acquire());  // a second user, no second open
  EXPECT_EQ(c.opens, 1);
  EXPECT_EQ(f->size(), 8u << 20);  // the driver's

  const auto t0 = ImageFile::Clock::now();
  auto busy = io::run_sync(**engine, f->close_if_idle(t0 + 1h, 0s));
  ASSERT_TRUE(busy);
  EXPECT_FALSE(busy->has_value());  // in use: nothing to schedule
  EXPECT_TRUE(f->is_open());
  f->release();
  EXPECT_EQ(c.idles, 0);
  f->release();
  EXPECT_EQ(c.idles, 1);  // the last user told the idle watcher

  auto early = io::run_sync(**engine, f->close_if_idle(ImageFile::Clock::now(), 10s));
  ASSERT_TRUE(early);
  ASSERT_TRUE(early->has_value());  // due later
  EXPECT_GT(**early, ImageFile::Clock::now() + 5s);
  EXPECT_TRUE(f->is_open());

  auto due = io::run_sync(**engine, f->close_if_idle(ImageFile::Clock::now() + 11s, 10s));
  ASSERT_TRUE(due);
  EXPECT_FALSE(due->has_value());
  EXPECT_FALSE(f->is_open());
  EXPECT_EQ(f->driver(), nullptr);
  EXPECT_EQ(f->size(), 8u << 20);  // the last size the driver had

  ASSERT_TRUE(io::run_sync(**engine, f->acquire()));  // reopened
  EXPECT_EQ(c.opens, 2);
  f->release();
  ASSERT_TRUE(io::run_sync(**engine, f->close()));
}

TEST(CatalogueImage, FailedOpenStaysClosedAndIsRetried) {
  Counts c;
  c.fail = true;
  auto f = counted_image(c);
  auto engine = io::make_engine(io::EngineKind::threads);
  ASSERT_TRUE(engine);
  Status st = io::run_sync(**engine, f->acquire());
  EXPECT_EQ(st.code(), EIO);
  EXPECT_FALSE(f->is_open());
  c.fail = false;
  ASSERT_TRUE(io::run_sync(**engine, f->acquire()));
  EXPECT_EQ(c.opens, 2);
  f->release();
  ASSERT_TRUE(io::run_sync(**engine, f->close()));
}

}  // namespace
}  // namespace qcowfs::fuse
