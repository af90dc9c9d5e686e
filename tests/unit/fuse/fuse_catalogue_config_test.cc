// CatalogueConfig (SRCDIR/.qcowfs.conf): the syntax, which rules apply to
// which image, and the refusals at mount.
#include <gtest/gtest.h>

#include "fuse/catalogue_config.h"

namespace qcowfs::fuse {
namespace {

Result<CatalogueConfig> parse(std::string_view text) { return CatalogueConfig::parse(text, "conf", "/src"); }

TEST(CatalogueConfig, EmptyTextHasNoRulesAndKeepsTheDefaults) {
  auto c = parse("# nothing\n\n   \n");
  ASSERT_TRUE(c) << c.status().to_string();
  EXPECT_EQ(c->rule_count(), 0u);
  EXPECT_FALSE(c->any_writable());
  image::ImageOptions defaults;
  defaults.file.cache = io::CacheMode::unsafe;
  image::ImageOptions o = c->options_for("vm.qcow2", defaults);
  EXPECT_FALSE(o.file.writable);
  EXPECT_EQ(o.file.cache, io::CacheMode::unsafe);
}

TEST(CatalogueConfig, MatchingRulesApplyInOrderLaterOptionsWin) {
  auto c = parse("*.qcow2 rw, cache=none\nvm2.qcow2 ro\nsub/* format=vmdk,key-file=k\n");
  ASSERT_TRUE(c) << c.status().to_string();
  EXPECT_TRUE(c->any_writable());
  image::ImageOptions vm1 = c->options_for("vm1.qcow2", {});
  EXPECT_TRUE(vm1.file.writable);
  EXPECT_EQ(vm1.file.cache, io::CacheMode::none);
  EXPECT_EQ(vm1.keys, nullptr);
  image::ImageOptions vm2 = c->options_for("vm2.qcow2", {});
  EXPECT_FALSE(vm2.file.writable);
  EXPECT_EQ(vm2.file.cache, io::CacheMode::none);
  image::ImageOptions sub = c->options_for("sub/d.img", {});
  EXPECT_EQ(sub.format, "vmdk");
  EXPECT_NE(sub.keys, nullptr);
  // '*' does not cross '/': sub/x.qcow2 is not matched by *.qcow2.
  EXPECT_FALSE(c->options_for("sub/x.qcow2", {}).file.writable);
}

TEST(CatalogueConfig, UnknownOptionsAndBadValuesNameTheLine) {
  for (std::string_view text : {"ok.qcow2 rw\nbad.qcow2 writeback=yes\n", "a rw\nb cache=sometimes\n",
                                "a rw\nb format=dmg\n", "a rw\nlonely\n", "a rw\nb key-file=\n"}) {
    auto c = parse(text);
    ASSERT_FALSE(c) << text;
    EXPECT_EQ(c.status().code(), EINVAL);
    EXPECT_NE(c.status().message().find("conf:2:"), std::string::npos) << c.status().message();
  }
}

}  // namespace
}  // namespace qcowfs::fuse
