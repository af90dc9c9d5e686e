// S3 pieces (io/remote/s3.h): credentials and region from INI files as the
// AWS CLI reads them (and hostile files refused, not misread), the order of
// the environment, the profile and the files, keys percent-encoded for SigV4,
// and the code and message of an S3 error body.
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "io/remote/s3.h"
#include "io_test_util.h"

namespace qcowfs::io {
namespace {

std::optional<S3Credentials> parse_ok(const std::string& text, const std::string& section) {
  auto r = s3_credentials_from_ini(text, section, "test");
  EXPECT_TRUE(r) << r.status().to_string();
  return r ? *r : std::nullopt;
}

TEST(S3Credentials, ReadsTheSectionAsTheAwsCliDoes) {
  const std::string text =
      "\xEF\xBB\xBF# comment\r\n"
      "[default]\r\n"
      "aws_access_key_id = AKIADEFAULT\r\n"
      "aws_secret_access_key=with;semicolon #and hash\r\n"
      "\n"
      "[other]\n"
      "AWS_ACCESS_KEY_ID = AKIAOTHER\n"
      "aws_secret_access_key = s2\n"
      "aws_session_token = " + std::string(4000, 'T') + "\n"
      "region = eu-west-3\n";
  auto d = parse_ok(text, "default");
  ASSERT_TRUE(d);
  EXPECT_EQ(d->access_key, "AKIADEFAULT");
  EXPECT_EQ(d->secret_key, "with;semicolon #and hash");  // no inline comments, as botocore
  EXPECT_EQ(d->session_token, "");
  auto o = parse_ok(text, "other");
  ASSERT_TRUE(o);
  EXPECT_EQ(o->access_key, "AKIAOTHER");  // option names are case-insensitive
  EXPECT_EQ(o->session_token, std::string(4000, 'T'));  // a long token is read whole
  EXPECT_EQ(o->region, "eu-west-3");
  EXPECT_FALSE(parse_ok(text, "missing"));
}

TEST(S3Credentials, RefusesHostileFiles) {
  const std::string section = "[default]\naws_access_key_id = A\naws_secret_access_key = B\n";
  for (const std::string& bad : std::vector<std::string>{
           section + std::string("junk\0more\n", 11),               // a NUL byte
           section + "x = " + std::string(20000, 'x') + "\n",         // a line past 16 KiB
           std::string(2u << 20, '#'),                                // past 1 MiB
           section + "aws_access_key_id = again\n",                   // given twice
           section + "  continued on a second line\n",                // a continuation of the secret
           "[default\naws_access_key_id = A\n",                       // no closing bracket
           "[default]\nno equals sign here\n",
       }) {
    auto r = s3_credentials_from_ini(bad, "default", "hostile");
    EXPECT_FALSE(r) << "accepted: " << bad.substr(0, 60);
    if (!r) {
      EXPECT_EQ(r.status().code(), EINVAL);
      EXPECT_NE(r.status().message().find("hostile"), std::string::npos) << r.status().message();
    }
  }
  // Binary noise without a NUL: refused or found empty, never a crash.
  std::string noise;
  for (int i = 0; i < 5000; ++i) noise += static_cast<char>(1 + (i * 7919) % 255);
  auto r = s3_credentials_from_ini(noise, "default", "noise");
  EXPECT_TRUE(!r || !*r);
}

struct Env {
  std::vector<std::string> names;
  void set(const char* name, const std::string& value) {
    ::setenv(name, value.c_str(), 1);
    names.emplace_back(name);
  }
  void unset(const char* name) {
    ::unsetenv(name);
    names.emplace_back(name);
  }
  ~Env() {
    for (const auto& n : names) ::unsetenv(n.c_str());
  }
};

TEST(S3Credentials, EnvironmentThenCredentialsFileThenConfigFile) {
  testing::TempFile creds("qcowfs_creds"), config("qcowfs_config");
  std::ofstream(creds.path()) << "[default]\naws_access_key_id = FILEKEY\naws_secret_access_key = FILESECRET\n"
                                 "[work]\naws_access_key_id = WORKKEY\naws_secret_access_key = WORKSECRET\n";
  std::ofstream(config.path()) << "[profile cfgonly]\naws_access_key_id = CFGKEY\naws_secret_access_key = CFG\n"
                                  "region = ap-south-1\n[profile work]\nregion = eu-north-1\n";
  Env env;
  env.set("AWS_SHARED_CREDENTIALS_FILE", creds.path());
  env.set("AWS_CONFIG_FILE", config.path());
  env.unset("AWS_ACCESS_KEY_ID");
  env.unset("AWS_SECRET_ACCESS_KEY");
  env.unset("AWS_PROFILE");
  auto c = resolve_s3_credentials();
  ASSERT_TRUE(c) << c.status().to_string();
  EXPECT_EQ(c->access_key, "FILEKEY");
  EXPECT_NE(c->source.find(creds.path()), std::string::npos);
  env.set("AWS_PROFILE", "work");
  c = resolve_s3_credentials();
  ASSERT_TRUE(c);
  EXPECT_EQ(c->access_key, "WORKKEY");
  EXPECT_EQ(c->region, "eu-north-1");  // the profile's region from the config file
  env.set("AWS_PROFILE", "cfgonly");
  c = resolve_s3_credentials();
  ASSERT_TRUE(c);
  EXPECT_EQ(c->access_key, "CFGKEY");
  env.set("AWS_PROFILE", "nosuch");
  c = resolve_s3_credentials();
  ASSERT_FALSE(c);
  EXPECT_NE(c.status().message().find("[nosuch]"), std::string::npos) << c.status().message();
  env.set("AWS_ACCESS_KEY_ID", "ENVKEY");  // the environment wins over any profile
  env.set("AWS_SECRET_ACCESS_KEY", "ENVSECRET");
  c = resolve_s3_credentials();
  ASSERT_TRUE(c);
  EXPECT_EQ(c->access_key, "ENVKEY");
  env.unset("AWS_SECRET_ACCESS_KEY");
  c = resolve_s3_credentials();
  ASSERT_FALSE(c);
  EXPECT_NE(c.status().message().find("partial"), std::string::npos);
}

TEST(S3, KeysArePercentEncodedForSigV4) {
  EXPECT_EQ(s3_encode_key("dir/disk.qcow2"), "dir/disk.qcow2");
  EXPECT_EQ(s3_encode_key("my disk+1 (copy).qcow2"), "my%20disk%2B1%20%28copy%29.qcow2");
  EXPECT_EQ(s3_encode_key("a%20b&c=d?e#f"), "a%2520b%26c%3Dd%3Fe%23f");
  EXPECT_EQ(s3_encode_key("\xc3\xa9t\xc3\xa9~_-."), "%C3%A9t%C3%A9~_-.");
}

TEST(S3, ErrorSummaryFromTheXmlBody) {
  EXPECT_EQ(s3_error_summary("<?xml version=\"1.0\"?><Error><Code>SignatureDoesNotMatch</Code><Message>The request "
                             "signature we calculated does not match</Message></Error>"),
            "SignatureDoesNotMatch: The request signature we calculated does not match");
  EXPECT_EQ(s3_error_summary("<Error><Code>NoSuchKey</Code></Error>"), "NoSuchKey");
  EXPECT_EQ(s3_error_summary("<html>403 Forbidden</html>"), "");
  EXPECT_EQ(s3_error_summary("<Code>Bad\x01\nCode</Code>"), "Bad  Code");
}

}  // namespace
}  // namespace qcowfs::io
