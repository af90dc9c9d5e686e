// Subcommand helpers: JSON rendering, qemu-img style sizes, option matching.
#include <gtest/gtest.h>

#include "fuse/cmd.h"
#include "fuse/cmd_json.h"
#include "fuse/options.h"

namespace qcowfs::fuse {
namespace {

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
  for (const char* c : {"create", "info", "check", "map"}) EXPECT_TRUE(is_subcommand(c)) << c;
  EXPECT_FALSE(is_subcommand("image.qcow2"));
  EXPECT_FALSE(is_subcommand("-o"));
}

TEST(MountHelperOptions, FstabAtimeFlagsAreAccepted) {
  // mount(8) hands fstab options such as "defaults,noatime" to the helper.
  std::vector<std::string> args = {"disk.qcow2", "/mnt", "-o", "rw,defaults,noatime,nodiratime,relatime,_netdev"};
  auto o = parse_command_line(args);
  ASSERT_TRUE(o.is_ok()) << o.status().to_string();
  EXPECT_TRUE(o->writable);
  std::vector<std::string> bad = {"disk.qcow2", "/mnt", "-o", "noatimes"};
  EXPECT_FALSE(parse_command_line(bad).is_ok());
}

}  // namespace
}  // namespace qcowfs::fuse
