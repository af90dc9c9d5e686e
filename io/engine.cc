#include "io/engine.h"

#include <atomic>
#include <fstream>
#include <string>

#include "io/log.h"
#include "io/thread_engine.h"
#include "io/uring_engine.h"

namespace qcowfs::io {
namespace {

thread_local Engine* t_current = nullptr;

// Why io_uring_queue_init failed, in the words an administrator would search for.
std::string uring_unavailable_reason(const Status& st) {
  std::ifstream sysctl("/proc/sys/kernel/io_uring_disabled");
  int disabled = 0;
  if (sysctl >> disabled && disabled != 0) return fmt::format("kernel.io_uring_disabled={}", disabled);
  return st.to_string();
}

}  // namespace

Engine* Engine::current() { return t_current; }

Engine* Engine::set_current(Engine* e) {
  Engine* prev = t_current;
  t_current = e;
  return prev;
}

Result<std::unique_ptr<Engine>> make_engine(EngineKind kind, unsigned queue_depth, EngineFeatures features) {
  if (kind != EngineKind::threads) {
    auto uring = UringEngine::create(queue_depth, features.uring_cmd);
    if (uring) return std::unique_ptr<Engine>(std::move(*uring));
    if (kind == EngineKind::io_uring) return uring.status().with_context("aio=io_uring");
    // Every event-loop thread makes an engine: say it once per process.
    static std::atomic<bool> warned{false};
    if (!warned.exchange(true))
      log::warn("io_uring unavailable ({}): using threads", uring_unavailable_reason(uring.status()));
  }
  auto threads = ThreadEngine::create();
  if (!threads) return threads.status();
  return std::unique_ptr<Engine>(std::move(*threads));
}

}  // namespace qcowfs::io
