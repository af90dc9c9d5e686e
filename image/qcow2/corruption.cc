#include "image/qcow2/corruption.h"

#include <cstddef>

#include "image/endian.h"
#include "image/qcow2/format.h"
#include "io/log.h"

namespace qcowfs::image::qcow2 {

Status Corruption::found(const std::string& path, std::string what) {
  log::error("{}: corrupt qcow2 metadata: {}", path, what);
  Status err = Status::errorf(EIO, "corrupt qcow2 metadata: {}", what);
  {
    std::lock_guard lk(mu_);
    if (first_.empty()) first_ = std::move(what);
  }
  State none = State::none;
  state_.compare_exchange_strong(none, State::found, std::memory_order_acq_rel);
  return err;
}

Task<bool> Corruption::mark(io::HostFile& file, Header& header, const std::string& path) {
  if (state_.exchange(State::marked, std::memory_order_acq_rel) == State::marked) co_return false;
  log::error("{}: marking the image corrupt (incompatible feature bit 1); further writes fail with EIO", path);
  header.incompatible_features |= kIncompatCorrupt;
  std::byte bits[sizeof(uint64_t)];
  store_be64(bits, header.incompatible_features);
  Status st = co_await file.write(offsetof(HeaderLayout, incompatible_features), bits);
  if (st) st = co_await file.flush();
  if (!st) log::error("{}: could not set the corrupt bit: {}", path, st.message());
  co_return true;
}

Task<Status> Corruption::signal(io::HostFile& file, Header& header, const std::string& path, std::string what) {
  Status err = Status::errorf(EIO, "qcow2 metadata corruption: {}; the image is now marked corrupt "
                                   "(repair it with qemu-img check -r all)", what);
  if (marked()) co_return err;
  (void)found(path, std::move(what));
  (void)co_await mark(file, header, path);
  co_return err;
}

Status Corruption::refuse_writes() const {
  if (!marked()) return Status::ok();
  return Status::error(EIO, "the qcow2 image was marked corrupt: only reads are allowed");
}

std::string Corruption::first_message() const {
  std::lock_guard lk(mu_);
  return first_;
}

}  // namespace qcowfs::image::qcow2
