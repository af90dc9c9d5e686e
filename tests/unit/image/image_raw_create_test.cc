// image::create_raw(): a new raw image of the size asked for, with host space
// for every byte when preallocated, flushed before it reports success; and
// prepare_raw_create(), the registry's create: qemu-img's Formatting text and
// its refusals (backing file, encryption, a qcow2 option, no size).
#include <gtest/gtest.h>

#include "image/raw/raw.h"
#include "io/mem_file.h"
#include "unit/io/io_test_util.h"

namespace qcowfs::image {
namespace {

using io::testing::run_now;

constexpr uint64_t kSize = 1024 * 1024;

TEST(CreateRaw, SparseImageHasTheSizeAndNoData) {
  io::MemFile f;
  ASSERT_TRUE(run_now(create_raw(f, kSize, false)).is_ok());
  EXPECT_EQ(f.size(), kSize);
  EXPECT_EQ(f.counters().write_zeroes, 0u);
  EXPECT_EQ(f.counters().flushes, 1u);
  EXPECT_EQ(f.unflushed_count(), 0u);
}

TEST(CreateRaw, PreallocatedImageZeroesEveryByte) {
  io::MemFile f;
  ASSERT_TRUE(run_now(create_raw(f, kSize, true)).is_ok());
  EXPECT_EQ(f.size(), kSize);
  EXPECT_EQ(f.counters().write_zeroes, 1u);
  EXPECT_EQ(f.unflushed_count(), 0u);
}

CreateRequest raw_request(std::vector<std::pair<std::string, std::string>> options) {
  CreateRequest r;
  r.path = "x.raw";
  r.size = kSize;
  r.options = std::move(options);
  return r;
}

TEST(CreateRaw, PrepareGivesQemuImgsFormattingText) {
  auto c = prepare_raw_create(raw_request({{"preallocation", "full"}}));
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_EQ((*c)->formatting(), "fmt=raw size=1048576");
  EXPECT_TRUE((*c)->extra_paths().empty());
}

TEST(CreateRaw, PrepareRefusesWhatARawImageCannotHave) {
  auto encrypted = prepare_raw_create(raw_request({{"encrypt.format", "luks"}}));
  ASSERT_FALSE(encrypted.is_ok());
  EXPECT_NE(encrypted.status().message().find("use -f luks"), std::string::npos);
  auto qcow2_option = prepare_raw_create(raw_request({{"cluster_size", "64K"}}));
  ASSERT_FALSE(qcow2_option.is_ok());
  EXPECT_NE(qcow2_option.status().message().find("Invalid parameter 'cluster_size'"), std::string::npos);
  auto bad_prealloc = prepare_raw_create(raw_request({{"preallocation", "sometimes"}}));
  EXPECT_EQ(bad_prealloc.status().code(), EINVAL);
  CreateRequest backed = raw_request({});
  backed.backing_file = "base.qcow2";
  auto b = prepare_raw_create(backed);
  ASSERT_FALSE(b.is_ok());
  EXPECT_EQ(b.status().message(), "x.raw: Backing file not supported for file format 'raw'");
  CreateRequest sizeless = raw_request({});
  sizeless.size.reset();
  EXPECT_EQ(prepare_raw_create(sizeless).status().code(), EINVAL);
}

}  // namespace
}  // namespace qcowfs::image
