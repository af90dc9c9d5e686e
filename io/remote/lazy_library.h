// LazyLibrary: a shared library opened on first use instead of linked, with a
// fixed list of its symbols resolved at once. qcowfs reaches libcurl and libnbd
// this way (io/remote/curl_loader.cc, io/remote/nbd_loader.cc define the libcurl
// and libnbd functions qcowfs calls, each forwarding to the symbol resolved here):
// they and their ~30 dependencies (TLS, Kerberos, LDAP, ICU...) cost the dynamic
// loader tens of milliseconds, which every qcowfs run paid even without a URL.
// Thread-safety: construction is not; once constructed (curl_library() and
// nbd_library() are function-local statics) it is immutable and safe to share.
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <vector>

namespace qcowfs::io {

class LazyLibrary {
 public:
  // dlopen(soname, RTLD_NOW | RTLD_LOCAL) and dlsym every name; package names the
  // distribution package in the message if that fails. The library is never
  // closed (threads may still be inside it at exit).
  LazyLibrary(const char* soname, const char* package, std::span<const char* const> names);
  LazyLibrary(const LazyLibrary&) = delete;
  LazyLibrary& operator=(const LazyLibrary&) = delete;

  // True if the library and every name were found; otherwise error() says why,
  // naming the library and its package, and every symbol() is null.
  bool loaded() const { return error_.empty(); }
  const std::string& error() const { return error_; }
  // The address of names[i].
  void* symbol(size_t i) const { return i < symbols_.size() ? symbols_[i] : nullptr; }
  std::span<const char* const> names() const { return names_; }

 private:
  std::span<const char* const> names_;
  std::vector<void*> symbols_;
  std::string error_;
};

// libcurl ("libcurl.so.4", package libcurl4) and libnbd ("libnbd.so.0", package
// libnbd0), loaded by the first call of any of their functions.
const LazyLibrary& curl_library();
const LazyLibrary& nbd_library();

}  // namespace qcowfs::io
