#include "io/remote/remote_stats.h"

#include <fmt/format.h>

#include <map>
#include <mutex>

namespace qcowfs::io {
namespace {

struct Registry {
  std::mutex mu;
  uint64_t next_id = 1;
  std::map<uint64_t, RemoteStatsRegistration::Describe> sources;  // by id: the order of opening
};

Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: files may unregister during exit
  return *r;
}

}  // namespace

void RemoteCounters::fill(RemoteStatsSnapshot& s) const {
  s.requests = requests.load(std::memory_order_relaxed);
  s.retries = retries.load(std::memory_order_relaxed);
  s.errors = errors.load(std::memory_order_relaxed);
  s.bytes_fetched = bytes_fetched.load(std::memory_order_relaxed);
  s.bytes_written = bytes_written.load(std::memory_order_relaxed);
  s.in_flight_bytes = in_flight_bytes.load(std::memory_order_relaxed);
  s.reconnects = reconnects.load(std::memory_order_relaxed);
}

RemoteStatsRegistration::RemoteStatsRegistration(Describe describe) {
  Registry& r = registry();
  std::lock_guard lk(r.mu);
  id_ = r.next_id++;
  r.sources.emplace(id_, std::move(describe));
}

void RemoteStatsRegistration::reset() {
  if (id_ == 0) return;
  Registry& r = registry();
  std::lock_guard lk(r.mu);
  r.sources.erase(id_);
  id_ = 0;
}

std::vector<RemoteStatsSnapshot> remote_stats_snapshot() {
  Registry& r = registry();
  std::lock_guard lk(r.mu);
  std::vector<RemoteStatsSnapshot> out;
  out.reserve(r.sources.size());
  for (const auto& [id, describe] : r.sources) out.push_back(describe());
  return out;
}

std::string format_remote_counters(const RemoteStatsSnapshot& s) {
  std::string line = fmt::format("{}: ", s.url);
  if (s.protocol != "nbd")
    line += fmt::format("{} block hits, {} misses, {} blocks ({} bytes) read ahead, ", s.cache_hits, s.cache_misses,
                        s.readahead_blocks, s.readahead_bytes);
  line += fmt::format("{} requests, {} bytes fetched, ", s.requests, s.bytes_fetched);
  if (s.protocol == "nbd") line += fmt::format("{} bytes written, {} reconnects, ", s.bytes_written, s.reconnects);
  line += fmt::format("{} retries, {} errors, {} bytes in flight", s.retries, s.errors, s.in_flight_bytes);
  return line;
}

std::string format_remote_identity(const RemoteStatsSnapshot& s) {
  std::string line = fmt::format("{}: {} bytes over {}", s.url, s.size, s.protocol);
  if (s.protocol != "nbd")
    line += fmt::format(", ETag {}, Last-Modified {}", s.etag.empty() ? "-" : s.etag,
                        s.last_modified.empty() ? "-" : s.last_modified);
  if (!s.settings.empty()) line += "; " + s.settings;
  return line;
}

}  // namespace qcowfs::io
