// libcurl and libnbd loaded on first use (io/remote/lazy_library.h): every
// function qcowfs defines in io/remote/curl_loader.cc and nbd_loader.cc resolves
// in the installed library, the variadic curl_*_setopt pass their argument with
// its option's type, a transfer runs through the forwarding functions, and a
// library or function that is missing is named in the error.
#include <curl/curl.h>
#include <errno.h>
#include <libnbd.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <string>

#include <gtest/gtest.h>

#include "io/remote/lazy_library.h"

namespace qcowfs::io {
namespace {

void expect_all_resolved(const LazyLibrary& lib) {
  ASSERT_TRUE(lib.loaded()) << lib.error();
  ASSERT_GT(lib.names().size(), 10u);
  for (size_t i = 0; i < lib.names().size(); ++i) EXPECT_NE(lib.symbol(i), nullptr) << lib.names()[i];
}

TEST(LazyLibrary, CurlResolvesEveryFunction) { expect_all_resolved(curl_library()); }

TEST(LazyLibrary, NbdResolvesEveryFunction) { expect_all_resolved(nbd_library()); }

TEST(LazyLibrary, MissingLibraryNamesItAndItsPackage) {
  const char* names[] = {"curl_easy_init"};
  LazyLibrary lib("libqcowfs-no-such-library.so.7", "qcowfs-no-such-package", names);
  EXPECT_FALSE(lib.loaded());
  EXPECT_NE(lib.error().find("cannot load libqcowfs-no-such-library.so.7"), std::string::npos) << lib.error();
  EXPECT_NE(lib.error().find("qcowfs-no-such-package package"), std::string::npos) << lib.error();
  EXPECT_EQ(lib.symbol(0), nullptr);
}

TEST(LazyLibrary, MissingFunctionIsNamed) {
  const char* names[] = {"curl_easy_init", "curl_no_such_function"};
  LazyLibrary lib("libcurl.so.4", "libcurl4", names);
  EXPECT_FALSE(lib.loaded());
  EXPECT_NE(lib.error().find("libcurl.so.4 has no function curl_no_such_function"), std::string::npos)
      << lib.error();
  EXPECT_EQ(lib.symbol(0), nullptr);
}

size_t count_bytes(char*, size_t size, size_t n, void* user) {
  *static_cast<size_t*>(user) += size * n;
  return size * n;
}

// Each type class of option: libcurl checks these values, so a wrongly passed
// argument shows as a wrong answer.
TEST(CurlShim, OptionsPassByTheirTypeClass) {
  CURL* e = curl_easy_init();
  ASSERT_NE(e, nullptr);
  int marker = 0;
  EXPECT_EQ(curl_easy_setopt(e, CURLOPT_PRIVATE, &marker), CURLE_OK);  // object pointer
  void* back = nullptr;
  EXPECT_EQ(curl_easy_getinfo(e, CURLINFO_PRIVATE, &back), CURLE_OK);
  EXPECT_EQ(back, &marker);
  EXPECT_EQ(curl_easy_setopt(e, CURLOPT_SSLVERSION, 1000L), CURLE_BAD_FUNCTION_ARGUMENT);  // long
  EXPECT_EQ(curl_easy_setopt(e, CURLOPT_SSLVERSION, static_cast<long>(CURL_SSLVERSION_TLSv1_2)), CURLE_OK);
  EXPECT_EQ(curl_easy_setopt(e, CURLOPT_MAXREDIRS, -2L), CURLE_BAD_FUNCTION_ARGUMENT);
  EXPECT_EQ(curl_easy_setopt(e, CURLOPT_MAXREDIRS, (1L << 32) - 2), CURLE_OK);  // -2 as a 32-bit int
  EXPECT_EQ(curl_easy_setopt(e, CURLOPT_MAXFILESIZE_LARGE, static_cast<curl_off_t>(-1)),  // off_t
            CURLE_BAD_FUNCTION_ARGUMENT);
  // As a 32-bit int this would be -1, refused.
  EXPECT_EQ(curl_easy_setopt(e, CURLOPT_MAXFILESIZE_LARGE, (static_cast<curl_off_t>(1) << 32) - 1), CURLE_OK);
  EXPECT_EQ(curl_easy_setopt(e, CURLOPT_URL, "file:///"), CURLE_OK);  // string
  curl_easy_cleanup(e);
  CURLM* m = curl_multi_init();
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(curl_multi_setopt(m, CURLMOPT_MAXCONNECTS, 4L), CURLM_OK);
  EXPECT_EQ(curl_multi_setopt(m, static_cast<CURLMoption>(CURLOPTTYPE_LONG + 9999), 1L), CURLM_UNKNOWN_OPTION);
  EXPECT_EQ(curl_multi_cleanup(m), CURLM_OK);
  EXPECT_STREQ(curl_easy_strerror(CURLE_OK), "No error");
}

// A file:// transfer through the multi interface: the write function (a
// function pointer option) sees every byte and getinfo reads an off_t back.
TEST(CurlShim, FileTransferThroughTheMultiInterface) {
  ASSERT_EQ(curl_global_init(CURL_GLOBAL_DEFAULT), CURLE_OK);
  char path[] = "/tmp/qcowfs-curl-shim-XXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  const std::string body(12345, 'q');
  ASSERT_EQ(write(fd, body.data(), body.size()), static_cast<ssize_t>(body.size()));
  close(fd);
  CURLM* m = curl_multi_init();
  CURL* e = curl_easy_init();
  ASSERT_TRUE(m && e);
  size_t seen = 0;
  curl_slist* headers = curl_slist_append(nullptr, "X-Test: 1");
  ASSERT_NE(headers, nullptr);
  EXPECT_EQ(curl_easy_setopt(e, CURLOPT_HTTPHEADER, headers), CURLE_OK);
  EXPECT_EQ(curl_easy_setopt(e, CURLOPT_URL, (std::string("file://") + path).c_str()), CURLE_OK);
  EXPECT_EQ(curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, count_bytes), CURLE_OK);
  EXPECT_EQ(curl_easy_setopt(e, CURLOPT_WRITEDATA, &seen), CURLE_OK);
  ASSERT_EQ(curl_multi_add_handle(m, e), CURLM_OK);
  int running = 1;
  for (int round = 0; running > 0 && round < 10000; ++round) {
    ASSERT_EQ(curl_multi_perform(m, &running), CURLM_OK);
    if (running > 0) {
      ASSERT_EQ(curl_multi_poll(m, nullptr, 0, 100, nullptr), CURLM_OK);
    }
  }
  int left = 0;
  CURLMsg* msg = curl_multi_info_read(m, &left);
  ASSERT_NE(msg, nullptr);
  EXPECT_EQ(msg->msg, CURLMSG_DONE);
  EXPECT_EQ(msg->data.result, CURLE_OK);
  EXPECT_EQ(seen, body.size());
  curl_off_t size = 0;
  EXPECT_EQ(curl_easy_getinfo(e, CURLINFO_SIZE_DOWNLOAD_T, &size), CURLE_OK);
  EXPECT_EQ(size, static_cast<curl_off_t>(body.size()));
  EXPECT_EQ(curl_multi_wakeup(m), CURLM_OK);
  EXPECT_EQ(curl_multi_remove_handle(m, e), CURLM_OK);
  curl_easy_cleanup(e);
  curl_slist_free_all(headers);
  EXPECT_EQ(curl_multi_cleanup(m), CURLM_OK);
  unlink(path);
}

TEST(NbdShim, HandleAndErrorsForwarded) {
  nbd_handle* h = nbd_create();
  ASSERT_NE(h, nullptr) << nbd_get_error();
  EXPECT_EQ(nbd_aio_is_created(h), 1);
  EXPECT_EQ(nbd_connect_uri(h, "nbd+unix:///?socket=/nonexistent/qcowfs-shim.sock"), -1);
  EXPECT_EQ(nbd_get_errno(), ENOENT);
  ASSERT_NE(nbd_get_error(), nullptr);
  EXPECT_NE(std::string(nbd_get_error()).find("connect"), std::string::npos) << nbd_get_error();
  nbd_close(h);
}

}  // namespace
}  // namespace qcowfs::io
