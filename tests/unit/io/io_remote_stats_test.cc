// Remote statistics (io/remote/remote_stats.h): registrations come and go with
// their files and a snapshot lists each one's numbers.
#include <algorithm>
#include <vector>

#include <gtest/gtest.h>

#include "io/remote/remote_stats.h"

namespace qcowfs::io {
namespace {

size_t count_url(const std::string& url) {
  auto all = remote_stats_snapshot();
  return static_cast<size_t>(std::count_if(all.begin(), all.end(), [&](const auto& s) { return s.url == url; }));
}

TEST(RemoteStats, RegistrationListsTheFileForItsLifetime) {
  RemoteCounters counters;
  {
    RemoteStatsRegistration reg([&] {
      RemoteStatsSnapshot s;
      s.url = "http://test/registered";
      s.protocol = "http";
      counters.fill(s);
      return s;
    });
    RemoteCounters::add(counters.requests, 3);
    RemoteCounters::add(counters.bytes_fetched, 4096);
    auto all = remote_stats_snapshot();
    auto it = std::find_if(all.begin(), all.end(), [](const auto& s) { return s.url == "http://test/registered"; });
    ASSERT_NE(it, all.end());
    EXPECT_EQ(it->requests, 3u);
    EXPECT_EQ(it->bytes_fetched, 4096u);
    const std::string line = format_remote_counters(*it);
    EXPECT_NE(line.find("3 requests, 4096 bytes fetched"), std::string::npos) << line;
  }
  EXPECT_EQ(count_url("http://test/registered"), 0u);
}

}  // namespace
}  // namespace qcowfs::io
