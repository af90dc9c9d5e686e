// RemoteOptions tests (io/remote/remote_options.h): option values and their
// refusals, header and token files read at parse time, the environment list
// used only when nothing was given, and which names are URLs.
#include <cstdlib>
#include <fstream>

#include <gtest/gtest.h>

#include "io/remote/remote_options.h"
#include "io_test_util.h"

namespace qcowfs::io {
namespace {

TEST(RemoteOptions, ParsesValuesAndRefusesBadOnes) {
  RemoteOptions o;
  EXPECT_TRUE(*apply_remote_option(o, "remote-block-size", "1M"));
  EXPECT_TRUE(*apply_remote_option(o, "remote-timeout", "5"));
  EXPECT_TRUE(*apply_remote_option(o, "sslverify", "off"));
  EXPECT_EQ(o.network_threads, 2u);
  EXPECT_TRUE(*apply_remote_option(o, "remote-threads", "3"));
  EXPECT_EQ(o.network_threads, 3u);
  EXPECT_EQ(o.block_size, 1u << 20);
  EXPECT_EQ(o.timeout_ms, 5000u);
  EXPECT_FALSE(o.ssl_verify);
  EXPECT_TRUE(o.set_by_user);
  EXPECT_FALSE(*apply_remote_option(o, "cache", "none"));  // not a remote option
  for (auto [k, v] : {std::pair{"remote-block-size", "3000"}, {"remote-timeout", "0"}, {"sslverify", "no"},
                      {"remote-connections", "x"}, {"remote-threads", "0"}, {"remote-threads", "9"},
                      {"token-file", "/nonexistent/token"}}) {
    auto r = apply_remote_option(o, k, v);
    ASSERT_FALSE(r) << k;
    EXPECT_NE(r.status().message().find(k), std::string::npos) << r.status().message();
  }
}

TEST(RemoteOptions, HeaderAndTokenFilesAreReadAtOnce) {
  testing::TempFile headers("qcowfs_headers"), token("qcowfs_token");
  std::ofstream(headers.path()) << "# comment\nX-One: 1\n\nX-Two: two words\n";
  std::ofstream(token.path()) << "s3cr3t\n";
  RemoteOptions o;
  ASSERT_TRUE(apply_remote_option_list(o, "header-file=" + headers.path() + ",token-file=" + token.path()));
  EXPECT_EQ(o.headers, (std::vector<std::string>{"X-One: 1", "X-Two: two words", "Authorization: Bearer s3cr3t"}));
  std::ofstream(headers.path()) << "no colon here\n";
  EXPECT_FALSE(apply_remote_option(o, "header-file", headers.path()));
}

TEST(RemoteOptions, EnvironmentOnlyWhenNothingWasGiven) {
  ::setenv("QCOWFS_REMOTE_OPTIONS", "remote-timeout=7", 1);
  RemoteOptions none;
  EXPECT_EQ(effective_remote_options(none)->timeout_ms, 7000u);
  RemoteOptions given;
  ASSERT_TRUE(*apply_remote_option(given, "sslverify", "off"));
  EXPECT_EQ(effective_remote_options(given)->timeout_ms, 30000u);
  ::setenv("QCOWFS_REMOTE_OPTIONS", "bogus=1", 1);
  EXPECT_FALSE(effective_remote_options(none));
  ::unsetenv("QCOWFS_REMOTE_OPTIONS");
}

TEST(RemoteOptions, WhichNamesAreUrls) {
  EXPECT_TRUE(is_remote_location("https://host/a.qcow2"));
  EXPECT_TRUE(is_remote_location("nbd+unix:///exp?socket=/run/s"));
  EXPECT_FALSE(is_remote_location("/var/lib/images/a.qcow2"));
  EXPECT_FALSE(is_remote_location("http:a.qcow2"));
  EXPECT_TRUE(has_url_scheme("ftp://host/x"));
  EXPECT_FALSE(has_url_scheme("dir/with://colon"));
  EXPECT_FALSE(has_url_scheme("://x"));
}

}  // namespace
}  // namespace qcowfs::io
