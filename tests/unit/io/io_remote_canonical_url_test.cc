// canonical_remote_location tests (io/remote/canonical_url.h): spellings of
// one remote image that must meet one daemon's control socket, spellings of
// different images that must not, and text curl cannot parse kept as written.
#include <unistd.h>

#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "io/control_socket.h"
#include "io/remote/canonical_url.h"
#include "io_test_util.h"

namespace qcowfs::io {
namespace {

std::string socket_name(const std::string& url) {
  auto name = control_socket_name(url);
  EXPECT_TRUE(name) << url;
  return name ? *name : "";
}

void expect_meet(const std::string& a, const std::string& b) {
  EXPECT_EQ(canonical_remote_location(a), canonical_remote_location(b)) << a << " vs " << b;
  EXPECT_EQ(socket_name(a), socket_name(b)) << a << " vs " << b;
}

void expect_apart(const std::string& a, const std::string& b) {
  EXPECT_NE(canonical_remote_location(a), canonical_remote_location(b)) << a << " vs " << b;
  EXPECT_NE(socket_name(a), socket_name(b)) << a << " vs " << b;
}

TEST(CanonicalUrl, HttpSpellingsOfOneUrlMeet) {
  EXPECT_EQ(canonical_remote_location("http://LOCALHOST:80/a.qcow2"), "http://localhost/a.qcow2");
  EXPECT_EQ(canonical_remote_location("https://Example.COM:443"), "https://example.com/");
  for (const char* other : {"http://LocalHost/a.qcow2", "http://localhost:80/a.qcow2", "http://localhost/x/../a.qcow2",
                            "http://localhost/./a.qcow2", "http://localhost/a.qcow2#part",
                            "http://localhost:80/b/./../a.qcow2"})
    expect_meet("http://localhost/a.qcow2", other);
  expect_meet("https://h.example/disk.qcow2", "https://H.EXAMPLE:443/disk.qcow2");
  expect_meet("http://127.0.0.1:8080/a", "http://127.1:8080/a");
  expect_meet("http://[::1]/a", "http://[0:0::1]:80/a");
  expect_meet("http://h/a%20b", "http://h/a b");  // curl encodes the space it would send
  // The password is left out; the user name stays (and different users stay apart).
  expect_meet("http://user:one@h/a", "http://user:two@H/a");
  EXPECT_EQ(canonical_remote_location("http://user:secret@h/a").find("secret"), std::string::npos);
  expect_apart("http://alice@h/a", "http://bob@h/a");
}

TEST(CanonicalUrl, HttpUrlsOfDifferentObjectsStayApart) {
  const std::string base = "http://localhost/a.qcow2";
  for (const char* other : {"http://otherhost/a.qcow2", "http://localhost:8080/a.qcow2", "https://localhost/a.qcow2",
                            "http://localhost/b.qcow2", "http://localhost/A.qcow2", "http://localhost/d/a.qcow2",
                            "http://localhost/a.qcow2?v=2", "http://127.0.0.1/a.qcow2"})
    expect_apart(base, other);
  // A presigned URL's query is part of the object's address: kept, in order.
  const std::string signed_url = "https://b.s3.amazonaws.com/k?X-Amz-Expires=60&X-Amz-Signature=ab12";
  EXPECT_EQ(canonical_remote_location(signed_url), signed_url);
  expect_meet(signed_url, "https://B.s3.amazonaws.com:443/k?X-Amz-Expires=60&X-Amz-Signature=ab12");
  expect_apart(signed_url, "https://b.s3.amazonaws.com/k?X-Amz-Expires=60&X-Amz-Signature=cd34");
  expect_apart(signed_url, "https://b.s3.amazonaws.com/k");
}

TEST(CanonicalUrl, NbdSpellingsMeetAndExportsStayApart) {
  EXPECT_EQ(canonical_remote_location("nbd://NBD.Example:10809/exp"), "nbd://nbd.example/exp");
  expect_meet("nbd://host/exp", "nbd://HOST:10809/exp");
  expect_meet("nbd://host/exp", "nbd://host/%65xp");  // libnbd decodes the export name
  expect_meet("nbd://host", "nbd://host/");           // both the default export ""
  expect_meet("nbd://host/exp?tls-verify-peer=false&tls-hostname=h",
              "nbd://host/exp?tls-hostname=h&tls-verify-peer=%66alse");
  for (const char* other : {"nbd://other/exp", "nbd://host:10810/exp", "nbd://host/exp2", "nbd://host/Exp",
                            "nbd://host/", "nbd://host/a/../exp", "nbd://host/exp?tls-hostname=h"})
    expect_apart("nbd://host/exp", other);
  // An export name is literal: "." and ".." are its own, and an encoded '%'
  // is not the character it would encode.
  expect_apart("nbd://host/a/../b", "nbd://host/b");
  expect_apart("nbd://host/a%2520", "nbd://host/a%20");
}

TEST(CanonicalUrl, NbdUnixSocketPathIsMadeCanonical) {
  testing::TempFile sock("qcowfs_nbd_sock");
  const std::filesystem::path real = std::filesystem::canonical(sock.path());
  const std::filesystem::path link = real.string() + ".link";
  std::filesystem::create_symlink(real, link);
  const std::string relative = std::filesystem::relative(real).string();
  const std::string base = "nbd+unix:///exp?socket=" + real.string();
  std::string encoded;  // the temporary file's name has no other reserved character
  for (char c : real.string()) encoded += c == '/' ? std::string("%2F") : std::string(1, c);
  EXPECT_EQ(canonical_remote_location(base), "nbd+unix:///exp?socket=" + encoded);
  for (const std::string& other :
       {"nbd+unix:///exp?socket=" + link.string(), "nbd+unix:///exp?socket=" + relative,
        "nbd+unix:///exp?socket=" + real.parent_path().string() + "/./" + real.filename().string(),
        "nbd+unix:///%65xp?socket=" + real.string(), "nbd+unix://localhost/exp?socket=" + real.string(),
        "nbd+unix:///exp?socket=" + real.string() + "&"})
    expect_meet(base, other);
  for (const std::string& other :
       {"nbd+unix:///other?socket=" + real.string(), "nbd+unix:///exp?socket=" + real.string() + "2",
        "nbd+unix:///?socket=" + real.string(), std::string("nbd://localhost/exp")})
    expect_apart(base, other);
  std::filesystem::remove(link);
  // A socket that does not exist (yet): absolute and lexically normal.
  expect_meet("nbd+unix:///e?socket=/nonexistent/dir/../x.sock", "nbd+unix:///e?socket=/nonexistent/x.sock");
}

TEST(CanonicalUrl, WhatCurlCannotParseOrMustNotTouchIsKeptAsWritten) {
  // S3 keys are literal (io/remote/s3.cc): no dot segments, no decoding, the bucket's case kept.
  for (const char* url : {"s3://MyBucket/key/../x%41", "http://h:99999/a", "http://a b/c", "nbd://u@host/exp"})
    EXPECT_EQ(canonical_remote_location(url), url);
  expect_apart("s3://bucket/a/../b", "s3://bucket/b");
  expect_apart("s3://Bucket/k", "s3://bucket/k");
}

TEST(PrintableUrl, HttpLosesPasswordQueryAndFragmentKeepsTheRest) {
  EXPECT_EQ(printable_remote_location("https://user:secret@Host:8443/a/b.qcow2?X-Amz-Signature=abc#frag"),
            "https://user@Host:8443/a/b.qcow2");
  EXPECT_EQ(printable_remote_location("http://h/a.qcow2"), "http://h/a.qcow2");
  EXPECT_EQ(printable_remote_location("http://h/x/../a.qcow2"), "http://h/x/../a.qcow2");
  // Cut as text, also where curl would refuse the URL; an '@' or ':' after the authority is not userinfo.
  EXPECT_EQ(printable_remote_location("http://us er:secret@h:99999/a?sig=x#f"), "http://us er@h:99999/a");
  EXPECT_EQ(printable_remote_location("http://h:99999/a@b:c?sig=x"), "http://h:99999/a@b:c");
  EXPECT_EQ(printable_remote_location("http://u:p@x@h:99999"), "http://u@h:99999");
}

TEST(PrintableUrl, NbdAndS3AreShownAsWritten) {
  for (const char* url : {"nbd://host:10809/exp", "nbd+unix:///exp?socket=/run/x.sock", "s3://Bucket/k/../x"})
    EXPECT_EQ(printable_remote_location(url), url);
}

}  // namespace
}  // namespace qcowfs::io
