#include "fuse/remote_status.h"

#include <fcntl.h>
#include <json-c/json.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <ctime>

#include "io/log.h"
#include "io/remote/remote_stats.h"

namespace qcowfs::fuse {
namespace {

json_object* remote_json(const io::RemoteStatsSnapshot& s) {
  json_object* o = json_object_new_object();
  auto str = [&](const char* k, const std::string& v) { json_object_object_add(o, k, json_object_new_string(v.c_str())); };
  auto num = [&](const char* k, uint64_t v) { json_object_object_add(o, k, json_object_new_uint64(v)); };
  str("url", s.url);
  str("protocol", s.protocol);
  num("size", s.size);
  str("etag", s.etag);
  str("last_modified", s.last_modified);
  str("settings", s.settings);
  num("cache_hits", s.cache_hits);
  num("cache_misses", s.cache_misses);
  num("readahead_blocks", s.readahead_blocks);
  num("readahead_bytes", s.readahead_bytes);
  num("requests", s.requests);
  num("retries", s.retries);
  num("errors", s.errors);
  num("bytes_fetched", s.bytes_fetched);
  num("bytes_written", s.bytes_written);
  num("in_flight_bytes", s.in_flight_bytes);
  num("reconnects", s.reconnects);
  if (!s.requests_per_thread.empty()) {
    json_object* a = json_object_new_array();
    for (uint64_t n : s.requests_per_thread) json_object_array_add(a, json_object_new_uint64(n));
    json_object_object_add(o, "requests_per_thread", a);
  }
  return o;
}

std::string utc_now() {
  timespec ts{};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  tm t{};
  ::gmtime_r(&ts.tv_sec, &t);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &t);
  return buf;
}

Status write_whole(const std::string& path, const std::string& text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOCTTY, 0644);
  if (fd < 0) return Status::from_errno(errno, path);
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : EIO;
      ::close(fd);
      return Status::from_errno(err, path);
    }
    done += static_cast<size_t>(n);
  }
  if (::close(fd) != 0) return Status::from_errno(errno, path);
  return Status::ok();
}

}  // namespace

RemoteStatusReporter::RemoteStatusReporter(std::string image, std::string mountpoint, std::string status_file)
    : image_(std::move(image)), mountpoint_(std::move(mountpoint)), status_file_(std::move(status_file)) {}

Status RemoteStatusReporter::at_mount() {
  if (!has_status_file()) return Status::ok();
  return write_status_file().with_context("status-file");
}

void RemoteStatusReporter::log_identities() {
  for (const io::RemoteStatsSnapshot& s : io::remote_stats_snapshot()) log::info("{}", io::format_remote_identity(s));
}

void RemoteStatusReporter::on_signal() {
  const auto all = io::remote_stats_snapshot();
  if (all.empty()) log::info("SIGUSR1: {} has no remote image files", image_);
  for (const io::RemoteStatsSnapshot& s : all) log::info("{}", io::format_remote_counters(s));
  refresh();
}

void RemoteStatusReporter::refresh() {
  if (!has_status_file()) return;
  Status st = write_status_file();
  if (st) {
    failure_logged_ = false;
  } else if (!failure_logged_) {
    log::warn("status-file: {}", st.to_string());
    failure_logged_ = true;
  }
}

Status RemoteStatusReporter::write_status_file() {
  json_object* root = json_object_new_object();
  json_object_object_add(root, "pid", json_object_new_int64(::getpid()));
  json_object_object_add(root, "image", json_object_new_string(image_.c_str()));
  json_object_object_add(root, "mountpoint", json_object_new_string(mountpoint_.c_str()));
  json_object_object_add(root, "sequence", json_object_new_uint64(++sequence_));
  json_object_object_add(root, "time", json_object_new_string(utc_now().c_str()));
  json_object* remotes = json_object_new_array();
  for (const io::RemoteStatsSnapshot& s : io::remote_stats_snapshot()) json_object_array_add(remotes, remote_json(s));
  json_object_object_add(root, "remotes", remotes);
  std::string text = json_object_to_json_string_ext(root, JSON_C_TO_STRING_PRETTY | JSON_C_TO_STRING_NOSLASHESCAPE);
  json_object_put(root);
  text += '\n';
  const std::string tmp = status_file_ + ".tmp";
  QCOWFS_TRY(write_whole(tmp, text));
  if (::rename(tmp.c_str(), status_file_.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return Status::from_errno(err, status_file_);
  }
  return Status::ok();
}

}  // namespace qcowfs::fuse
