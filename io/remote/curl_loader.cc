// The libcurl functions qcowfs calls, defined here with curl.h's prototypes and
// forwarding to libcurl.so.4 loaded on first use (io/remote/lazy_library.h says
// why). A libcurl function called anywhere in qcowfs but not listed here is an
// undefined reference at link time: add it to QCOWFS_CURL_FUNCTIONS and below.
// Without the library each call fails as libcurl itself reports failure
// (curl_easy_init and curl_multi_init return NULL, ...), after one logged error
// naming the library and its package.
// Thread-safety: as libcurl's; the library is loaded once (a function-local static).
#include <curl/curl.h>

#include <cstdarg>

#include "io/log.h"
#include "io/remote/lazy_library.h"

#define QCOWFS_CURL_FUNCTIONS(X) \
  X(curl_easy_cleanup)           \
  X(curl_easy_escape)            \
  X(curl_easy_getinfo)           \
  X(curl_easy_header)            \
  X(curl_easy_init)              \
  X(curl_easy_setopt)            \
  X(curl_easy_strerror)          \
  X(curl_easy_unescape)          \
  X(curl_free)                   \
  X(curl_global_init)            \
  X(curl_multi_add_handle)       \
  X(curl_multi_cleanup)          \
  X(curl_multi_info_read)        \
  X(curl_multi_init)             \
  X(curl_multi_perform)          \
  X(curl_multi_poll)             \
  X(curl_multi_remove_handle)    \
  X(curl_multi_setopt)           \
  X(curl_multi_wakeup)           \
  X(curl_slist_append)           \
  X(curl_slist_free_all)         \
  X(curl_url)                    \
  X(curl_url_cleanup)            \
  X(curl_url_get)                \
  X(curl_url_set)

namespace qcowfs::io {
namespace curl_shim {

enum Fn : size_t {
#define QCOWFS_CURL_ENUM(name) k_##name,
  QCOWFS_CURL_FUNCTIONS(QCOWFS_CURL_ENUM)
#undef QCOWFS_CURL_ENUM
};

constexpr const char* kNames[] = {
#define QCOWFS_CURL_NAME(name) #name,
    QCOWFS_CURL_FUNCTIONS(QCOWFS_CURL_NAME)
#undef QCOWFS_CURL_NAME
};

template <typename F>
F real(Fn fn) {
  return reinterpret_cast<F>(curl_library().symbol(fn));
}

// The one argument after the option of curl_easy_setopt / curl_multi_setopt,
// read by the option's type class as libcurl reads it, passed on with that type.
template <typename R, typename H, typename O>
R forward_option(R (*f)(H, O, ...), H handle, O option, va_list args) {
  using AnyFunction = void (*)();
  const long o = static_cast<long>(option);
  if (o < CURLOPTTYPE_OBJECTPOINT) return f(handle, option, va_arg(args, long));
  if (o < CURLOPTTYPE_FUNCTIONPOINT) return f(handle, option, va_arg(args, void*));
  if (o < CURLOPTTYPE_OFF_T) return f(handle, option, va_arg(args, AnyFunction));
  if (o < CURLOPTTYPE_BLOB) return f(handle, option, va_arg(args, curl_off_t));
  return f(handle, option, va_arg(args, void*));
}

}  // namespace curl_shim

const LazyLibrary& curl_library() {
  static const LazyLibrary lib("libcurl.so.4", "libcurl4", curl_shim::kNames);
  static const bool reported = [] {
    if (!lib.loaded()) log::error("{}", lib.error());
    return true;
  }();
  (void)reported;
  return lib;
}

}  // namespace qcowfs::io

#define QCOWFS_CURL_REAL(name) \
  (::qcowfs::io::curl_shim::real<decltype(&::name)>(::qcowfs::io::curl_shim::k_##name))

// The names are in parentheses: curl.h may define some as type-checking macros.
CURLcode(curl_global_init)(long flags) {
  auto f = QCOWFS_CURL_REAL(curl_global_init);
  return f ? f(flags) : CURLE_FAILED_INIT;
}

CURL*(curl_easy_init)(void) {
  auto f = QCOWFS_CURL_REAL(curl_easy_init);
  return f ? f() : nullptr;
}

void(curl_easy_cleanup)(CURL* curl) {
  if (auto f = QCOWFS_CURL_REAL(curl_easy_cleanup)) f(curl);
}

// The variadic functions take an enum as their last named parameter (libcurl's
// own prototypes), which va_start accepts as libcurl itself does: CURLoption,
// CURLINFO and CURLMoption promote to int (all their values fit), and the named
// parameters are never read through the va_list. clang flags any enum there (-Wvarargs); gcc does not.
#if defined(__clang__)
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wvarargs"
#endif

CURLcode(curl_easy_setopt)(CURL* curl, CURLoption option, ...) {
  auto f = QCOWFS_CURL_REAL(curl_easy_setopt);
  if (!f) return CURLE_FAILED_INIT;
  va_list args;
  va_start(args, option);
  const CURLcode rc = qcowfs::io::curl_shim::forward_option(f, curl, option, args);
  va_end(args);
  return rc;
}

CURLcode(curl_easy_getinfo)(CURL* curl, CURLINFO info, ...) {
  auto f = QCOWFS_CURL_REAL(curl_easy_getinfo);
  if (!f) return CURLE_FAILED_INIT;
  va_list args;
  va_start(args, info);
  void* out = va_arg(args, void*);  // every CURLINFO takes one pointer
  va_end(args);
  return f(curl, info, out);
}

CURLHcode(curl_easy_header)(CURL* easy, const char* name, size_t index, unsigned int origin, int request,
                            struct curl_header** hout) {
  auto f = QCOWFS_CURL_REAL(curl_easy_header);
  return f ? f(easy, name, index, origin, request, hout) : CURLHE_NOT_BUILT_IN;
}

const char*(curl_easy_strerror)(CURLcode code) {
  auto f = QCOWFS_CURL_REAL(curl_easy_strerror);
  return f ? f(code) : qcowfs::io::curl_library().error().c_str();
}

CURLM*(curl_multi_init)(void) {
  auto f = QCOWFS_CURL_REAL(curl_multi_init);
  return f ? f() : nullptr;
}

CURLMcode(curl_multi_setopt)(CURLM* multi_handle, CURLMoption option, ...) {
  auto f = QCOWFS_CURL_REAL(curl_multi_setopt);
  if (!f) return CURLM_BAD_HANDLE;
  va_list args;
  va_start(args, option);
  const CURLMcode rc = qcowfs::io::curl_shim::forward_option(f, multi_handle, option, args);
  va_end(args);
  return rc;
}

#if defined(__clang__)
#pragma clang diagnostic pop
#endif

CURLMcode(curl_multi_add_handle)(CURLM* multi_handle, CURL* curl_handle) {
  auto f = QCOWFS_CURL_REAL(curl_multi_add_handle);
  return f ? f(multi_handle, curl_handle) : CURLM_BAD_HANDLE;
}

CURLMcode(curl_multi_remove_handle)(CURLM* multi_handle, CURL* curl_handle) {
  auto f = QCOWFS_CURL_REAL(curl_multi_remove_handle);
  return f ? f(multi_handle, curl_handle) : CURLM_BAD_HANDLE;
}

CURLMcode(curl_multi_perform)(CURLM* multi_handle, int* running_handles) {
  auto f = QCOWFS_CURL_REAL(curl_multi_perform);
  return f ? f(multi_handle, running_handles) : CURLM_BAD_HANDLE;
}

CURLMcode(curl_multi_poll)(CURLM* multi_handle, struct curl_waitfd extra_fds[], unsigned int extra_nfds,
                           int timeout_ms, int* ret) {
  auto f = QCOWFS_CURL_REAL(curl_multi_poll);
  return f ? f(multi_handle, extra_fds, extra_nfds, timeout_ms, ret) : CURLM_BAD_HANDLE;
}

CURLMcode(curl_multi_wakeup)(CURLM* multi_handle) {
  auto f = QCOWFS_CURL_REAL(curl_multi_wakeup);
  return f ? f(multi_handle) : CURLM_BAD_HANDLE;
}

CURLMsg*(curl_multi_info_read)(CURLM* multi_handle, int* msgs_in_queue) {
  auto f = QCOWFS_CURL_REAL(curl_multi_info_read);
  return f ? f(multi_handle, msgs_in_queue) : nullptr;
}

CURLMcode(curl_multi_cleanup)(CURLM* multi_handle) {
  auto f = QCOWFS_CURL_REAL(curl_multi_cleanup);
  return f ? f(multi_handle) : CURLM_BAD_HANDLE;
}

struct curl_slist*(curl_slist_append)(struct curl_slist* list, const char* data) {
  auto f = QCOWFS_CURL_REAL(curl_slist_append);
  return f ? f(list, data) : nullptr;
}

void(curl_slist_free_all)(struct curl_slist* list) {
  if (auto f = QCOWFS_CURL_REAL(curl_slist_free_all)) f(list);
}

char*(curl_easy_escape)(CURL* handle, const char* string, int length) {
  auto f = QCOWFS_CURL_REAL(curl_easy_escape);
  return f ? f(handle, string, length) : nullptr;
}

char*(curl_easy_unescape)(CURL* handle, const char* string, int length, int* outlength) {
  auto f = QCOWFS_CURL_REAL(curl_easy_unescape);
  return f ? f(handle, string, length, outlength) : nullptr;
}

void(curl_free)(void* p) {
  if (auto f = QCOWFS_CURL_REAL(curl_free)) f(p);
}

// The URL API (io/remote/canonical_url.cc). Without the library: no handle,
// and every call fails as on a handle libcurl refused.
CURLU*(curl_url)(void) {
  auto f = QCOWFS_CURL_REAL(curl_url);
  return f ? f() : nullptr;
}

void(curl_url_cleanup)(CURLU* handle) {
  if (auto f = QCOWFS_CURL_REAL(curl_url_cleanup)) f(handle);
}

CURLUcode(curl_url_get)(CURLU* handle, CURLUPart what, char** part, unsigned int flags) {
  auto f = QCOWFS_CURL_REAL(curl_url_get);
  return f ? f(handle, what, part, flags) : CURLUE_BAD_HANDLE;
}

CURLUcode(curl_url_set)(CURLU* handle, CURLUPart what, const char* part, unsigned int flags) {
  auto f = QCOWFS_CURL_REAL(curl_url_set);
  return f ? f(handle, what, part, flags) : CURLUE_BAD_HANDLE;
}

#undef QCOWFS_CURL_REAL
#undef QCOWFS_CURL_FUNCTIONS
