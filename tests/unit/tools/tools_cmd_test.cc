// Subcommand helpers: JSON rendering, qemu-img style sizes, option matching;
// the block status `qcowfs map` prints (host offsets of raw files, host holes
// under preallocated qcow2 data).
#include <gtest/gtest.h>

#include "tools/cmd.h"
#include "image/json.h"
#include "image/extent/host_holes.h"
#include "image/raw/raw.h"
#include "image/views/window.h"
#include "io/mem_file.h"
#include "unit/io/io_test_util.h"

namespace qcowfs::tools {
namespace {

using io::testing::run_now;

constexpr uint64_t kKiB = 1024;

// A sparse 64 KiB file with data only in [16K, 24K).
std::unique_ptr<io::MemFile> sparse_file() {
  auto f = std::make_unique<io::MemFile>();
  EXPECT_TRUE(run_now(f->truncate(64 * kKiB)).is_ok());
  std::vector<std::byte> data(8 * kKiB, std::byte{0x5a});
  EXPECT_TRUE(run_now(f->write(16 * kKiB, data)).is_ok());
  return f;
}

TEST(MapStatus, RawRangesCarryTheirHostOffsets) {
  auto f = sparse_file();
  image::RawDriver d(f.get(), false, 4 * kKiB, 128 * kKiB);  // a window starting 4K in, past the file end
  auto hole = run_now(d.block_status(0, 128 * kKiB));
  ASSERT_TRUE(hole.is_ok()) << hole.status().to_string();
  EXPECT_EQ(hole->length, 12 * kKiB);
  EXPECT_TRUE(hole->zero);
  EXPECT_FALSE(hole->data);
  EXPECT_TRUE(hole->present);
  EXPECT_EQ(hole->file, f.get());
  EXPECT_EQ(hole->host_offset, 4 * kKiB);
  auto data = run_now(d.block_status(13 * kKiB, 100 * kKiB));
  ASSERT_TRUE(data.is_ok());
  EXPECT_EQ(data->length, 7 * kKiB);
  EXPECT_TRUE(data->data);
  EXPECT_FALSE(data->zero);
  EXPECT_EQ(data->host_offset, 17 * kKiB);
  // The hole after the data runs to the end of the file, and the window on.
  auto tail = run_now(d.block_status(20 * kKiB, 108 * kKiB));
  ASSERT_TRUE(tail.is_ok());
  EXPECT_EQ(tail->length, 108 * kKiB);
  EXPECT_TRUE(tail->zero);
  auto past = run_now(d.block_status(70 * kKiB, 8 * kKiB));
  ASSERT_TRUE(past.is_ok());
  EXPECT_EQ(past->length, 8 * kKiB);
  EXPECT_TRUE(past->zero);
  EXPECT_FALSE(past->data);
  EXPECT_EQ(past->host_offset, 74 * kKiB);
}

TEST(MapStatus, WindowKeepsTheParentsHostOffsets) {
  auto f = sparse_file();
  image::RawDriver parent(f.get(), false);
  image::WindowDriver w(&parent, 8 * kKiB, 16 * kKiB);
  auto st = run_now(w.block_status(8 * kKiB, 8 * kKiB));
  ASSERT_TRUE(st.is_ok());
  EXPECT_TRUE(st->data);
  EXPECT_EQ(st->host_offset, 16 * kKiB);
  EXPECT_EQ(st->length, 8 * kKiB);  // clipped to the window
}

image::BlockStatus preallocated_data(const io::HostFile& f, uint64_t host, uint64_t length) {
  image::BlockStatus st;
  st.length = length;
  st.data = st.present = true;
  st.file = &f;
  st.host_offset = host;
  return st;
}

TEST(MapStatus, HostHolesUnderPreallocatedDataReadAsZeros) {
  auto f = sparse_file();
  auto in_hole = preallocated_data(*f, 4 * kKiB, 32 * kKiB);
  ASSERT_TRUE(run_now(image::apply_host_holes(*f, in_hole)).is_ok());
  EXPECT_TRUE(in_hole.zero);
  EXPECT_TRUE(in_hole.data);
  EXPECT_EQ(in_hole.length, 12 * kKiB);  // up to the host data
  auto on_data = preallocated_data(*f, 20 * kKiB, 32 * kKiB);
  ASSERT_TRUE(run_now(image::apply_host_holes(*f, on_data)).is_ok());
  EXPECT_FALSE(on_data.zero);
  EXPECT_EQ(on_data.length, 4 * kKiB);  // up to the next hole
  // A hole reaching the end of the file covers the whole range, past the end too.
  auto trailing = preallocated_data(*f, 60 * kKiB, 32 * kKiB);
  ASSERT_TRUE(run_now(image::apply_host_holes(*f, trailing)).is_ok());
  EXPECT_TRUE(trailing.zero);
  EXPECT_EQ(trailing.length, 32 * kKiB);
  auto beyond = preallocated_data(*f, 96 * kKiB, 8 * kKiB);
  ASSERT_TRUE(run_now(image::apply_host_holes(*f, beyond)).is_ok());
  EXPECT_TRUE(beyond.zero);
  EXPECT_EQ(beyond.length, 8 * kKiB);
}

TEST(Json, RendersLikeQemuImg) {
  Json j = Json::object();
  j.set("a", uint64_t{1}).set("b", "x\"y").set("c", true);
  Json list = Json::array();
  list.push(int64_t{-2});
  j.set("d", std::move(list));
  EXPECT_EQ(j.render(), "{\n    \"a\": 1,\n    \"b\": \"x\\\"y\",\n    \"c\": true,\n    \"d\": [\n        -2\n    ]\n}");
  Json e = Json::object();
  e.set("start", uint64_t{0}).set("data", false);
  EXPECT_EQ(e.render_compact(), "{ \"start\": 0, \"data\": false}");
  EXPECT_EQ(Json::array().render(), "[]");
}

TEST(HumanSize, MatchesQemuImgFormatting) {
  EXPECT_EQ(human_size(0), "0 B");
  EXPECT_EQ(human_size(512), "512 B");
  EXPECT_EQ(human_size(200704), "196 KiB");
  EXPECT_EQ(human_size(1331200), "1.27 MiB");
  EXPECT_EQ(human_size(10485760), "10 MiB");
  EXPECT_EQ(human_size(1000), "0.977 KiB");
  EXPECT_EQ(human_size(1ull << 40), "1 TiB");
}

TEST(TakeOption, LongShortAndAttachedForms) {
  std::vector<std::string> args = {"--output=json", "-r", "all", "-fqcow2", "--format", "raw", "-x"};
  std::string v;
  size_t i = 0;
  EXPECT_TRUE(take_option(args, i, "--output", "", v));
  EXPECT_EQ(v, "json");
  i = 1;
  EXPECT_TRUE(take_option(args, i, "--repair", "-r", v));
  EXPECT_EQ(v, "all");
  EXPECT_EQ(i, 2u);
  i = 3;
  EXPECT_TRUE(take_option(args, i, "--format", "-f", v));
  EXPECT_EQ(v, "qcow2");
  i = 4;
  EXPECT_TRUE(take_option(args, i, "--format", "-f", v));
  EXPECT_EQ(v, "raw");
  i = 6;
  EXPECT_FALSE(take_option(args, i, "--format", "-f", v)) << "a flag without a value";
}

TEST(Subcommands, AreRecognised) {
  for (const char* c : {"create", "info", "check", "map", "resize", "snapshot"}) EXPECT_TRUE(is_subcommand(c)) << c;
  EXPECT_FALSE(is_subcommand("image.qcow2"));
  EXPECT_FALSE(is_subcommand("-o"));
}

TEST(ImageCommandArgs, ForceShareTakesQemuImgNames) {
  for (const char* flag : {"-U", "--force-share"}) {
    std::vector<std::string> args = {flag, "disk.qcow2"};
    ImageCommandArgs a;
    ASSERT_TRUE(parse_image_command(args, a, [](std::span<const std::string>, size_t&) -> Result<bool> {
      return false;
    }));
    EXPECT_TRUE(a.force_share) << flag;
    EXPECT_TRUE(a.read_options().force_share) << flag;
    EXPECT_FALSE(a.read_options().writable) << flag;
    EXPECT_EQ(a.image, "disk.qcow2");
  }
  for (auto usage : {info_usage(), map_usage(), check_usage()})
    EXPECT_NE(usage.find("-U, --force-share"), std::string_view::npos) << usage;
}

}  // namespace
}  // namespace qcowfs::tools
