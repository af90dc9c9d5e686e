// The image-locking mount options (locking=, force-share) as QEMU names them.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "fuse/options.h"

namespace qcowfs::fuse {
namespace {

Result<Options> parse(std::vector<std::string> args) {
  args.push_back("img.qcow2");
  args.push_back("mnt");
  return parse_command_line(args);
}

TEST(LockOptions, DefaultsAreAutoWithoutForceShare) {
  auto o = parse({});
  ASSERT_TRUE(o) << o.status().to_string();
  EXPECT_EQ(o->image_options.file.locking, io::LockMode::automatic);
  EXPECT_FALSE(o->image_options.file.force_share);
}

TEST(LockOptions, LockingValues) {
  EXPECT_EQ(parse({"-o", "locking=off"})->image_options.file.locking, io::LockMode::off);
  EXPECT_EQ(parse({"-o", "locking=on"})->image_options.file.locking, io::LockMode::on);
  EXPECT_EQ(parse({"-o", "locking=auto"})->image_options.file.locking, io::LockMode::automatic);
  auto bad = parse({"-o", "locking=maybe"});
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.status().message().find("locking"), std::string::npos) << bad.status().message();
}

TEST(LockOptions, ForceShareFlagAndValue) {
  EXPECT_TRUE(parse({"-o", "force-share"})->image_options.file.force_share);
  EXPECT_TRUE(parse({"-o", "ro,force-share=on"})->image_options.file.force_share);
  EXPECT_FALSE(parse({"-o", "force-share,force-share=off"})->image_options.file.force_share);
  EXPECT_FALSE(parse({"-o", "force-share=yes"}));
}

TEST(LockOptions, UsageMentionsThem) {
  std::string text = usage_text("qcowfs");
  EXPECT_NE(text.find("locking="), std::string::npos);
  EXPECT_NE(text.find("force-share"), std::string::npos);
}

}  // namespace
}  // namespace qcowfs::fuse
