// Status and Result<T>: the project's one error type. A Status is either ok or
// an errno value with a human-readable message. errno is turned into a Status
// once, at the syscall or I/O completion (Status::from_errno), and turned back
// into an errno reply only in fuse/. An ok Status is an int and a null
// pointer: every coroutine returns one, so its moves must cost no string copy.
// Thread-safety: plain values; copy freely between threads.
#pragma once

#include <cerrno>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include <fmt/format.h>

namespace qcowfs {

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(const Status& o) : code_(o.code_), message_(o.message_ ? std::make_unique<std::string>(*o.message_) : nullptr) {}
  Status& operator=(const Status& o) {
    if (this != &o) *this = Status(o);
    return *this;
  }
  Status(Status&& o) noexcept = default;
  Status& operator=(Status&& o) noexcept = default;
  ~Status() = default;
  static Status ok() { return Status(); }
  // err is a positive errno value (EIO, ENOSPC, ...).
  static Status error(int err, std::string message) { return Status(err, std::move(message)); }
  template <typename... Args>
  static Status errorf(int err, fmt::format_string<Args...> f, Args&&... args) {
    return Status(err, fmt::format(f, std::forward<Args>(args)...));
  }
  // Builds a Status from a (positive or negative) errno and a description of what failed.
  static Status from_errno(int err, std::string_view what);

  bool is_ok() const { return code_ == 0; }
  explicit operator bool() const { return is_ok(); }
  int code() const { return code_; }  // 0 or a positive errno
  const std::string& message() const { return message_ ? *message_ : empty_message(); }
  std::string to_string() const;
  // Prepends context: "opening base.qcow2: <message>".
  Status with_context(std::string_view context) const;

 private:
  Status(int err, std::string message)
      : code_(err), message_(message.empty() ? nullptr : std::make_unique<std::string>(std::move(message))) {}
  static const std::string& empty_message();
  int code_ = 0;
  std::unique_ptr<std::string> message_;  // null: no message
};

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {  // NOLINT
    if (status_.is_ok()) status_ = Status::error(EINVAL, "Result built from an ok Status without a value");
  }
  bool is_ok() const { return value_.has_value(); }
  explicit operator bool() const { return is_ok(); }
  const Status& status() const { return status_; }
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }
  T& operator*() { return *value_; }
  const T& operator*() const { return *value_; }

 private:
  std::optional<T> value_;
  Status status_;
};

}  // namespace qcowfs

// Early-return helpers. QCOWFS_TRY works in normal functions; QCOWFS_CO_TRY in coroutines.
#define QCOWFS_TRY(expr)                      \
  do {                                        \
    ::qcowfs::Status qcowfs_st_ = (expr);     \
    if (!qcowfs_st_.is_ok()) return qcowfs_st_; \
  } while (0)
#define QCOWFS_CO_TRY(expr)                      \
  do {                                           \
    ::qcowfs::Status qcowfs_st_ = (expr);        \
    if (!qcowfs_st_.is_ok()) co_return qcowfs_st_; \
  } while (0)
