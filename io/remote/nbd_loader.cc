// The libnbd functions qcowfs calls, defined here with libnbd.h's prototypes and
// forwarding to libnbd.so.0 loaded on first use (io/remote/lazy_library.h says
// why). A libnbd function called anywhere in qcowfs but not listed here is an
// undefined reference at link time: add it to QCOWFS_NBD_FUNCTIONS and below.
// Without the library nbd_create returns NULL and nbd_get_error / nbd_get_errno
// say why (naming the library and its package), as for any nbd_create failure;
// the other functions need a handle, so are never reached then (they fail as
// libnbd does on an error, returning -1).
// Thread-safety: as libnbd's; the library is loaded once (a function-local static).
#include <errno.h>
#include <libnbd.h>

#include "io/remote/lazy_library.h"

#define QCOWFS_NBD_FUNCTIONS(X) \
  X(nbd_add_meta_context)       \
  X(nbd_aio_block_status)       \
  X(nbd_aio_connect_uri)        \
  X(nbd_aio_flush)              \
  X(nbd_aio_get_direction)      \
  X(nbd_aio_get_fd)             \
  X(nbd_aio_is_closed)          \
  X(nbd_aio_is_created)         \
  X(nbd_aio_is_dead)            \
  X(nbd_aio_is_ready)           \
  X(nbd_aio_notify_read)        \
  X(nbd_aio_notify_write)       \
  X(nbd_aio_pread)              \
  X(nbd_aio_pwrite)             \
  X(nbd_aio_trim)               \
  X(nbd_aio_zero)               \
  X(nbd_can_flush)              \
  X(nbd_can_meta_context)       \
  X(nbd_can_trim)               \
  X(nbd_can_zero)               \
  X(nbd_close)                  \
  X(nbd_connect_uri)            \
  X(nbd_create)                 \
  X(nbd_get_errno)              \
  X(nbd_get_error)              \
  X(nbd_get_size)               \
  X(nbd_is_read_only)           \
  X(nbd_set_pread_initialize)

namespace qcowfs::io {
namespace nbd_shim {

enum Fn : size_t {
#define QCOWFS_NBD_ENUM(name) k_##name,
  QCOWFS_NBD_FUNCTIONS(QCOWFS_NBD_ENUM)
#undef QCOWFS_NBD_ENUM
};

constexpr const char* kNames[] = {
#define QCOWFS_NBD_NAME(name) #name,
    QCOWFS_NBD_FUNCTIONS(QCOWFS_NBD_NAME)
#undef QCOWFS_NBD_NAME
};

template <typename F>
F real(Fn fn) {
  return reinterpret_cast<F>(nbd_library().symbol(fn));
}

}  // namespace nbd_shim

const LazyLibrary& nbd_library() {
  static const LazyLibrary lib("libnbd.so.0", "libnbd0", nbd_shim::kNames);
  return lib;
}

}  // namespace qcowfs::io

#define QCOWFS_NBD_REAL(name) (::qcowfs::io::nbd_shim::real<decltype(&::name)>(::qcowfs::io::nbd_shim::k_##name))
// A function of a handle: without the library there is no handle, and -1 is
// libnbd's error answer.
#define QCOWFS_NBD_HANDLE_FN(ret, name, params, args) \
  ret name params {                                   \
    auto f = QCOWFS_NBD_REAL(name);                   \
    return f ? f args : static_cast<ret>(-1);         \
  }

struct nbd_handle* nbd_create(void) {
  auto f = QCOWFS_NBD_REAL(nbd_create);
  return f ? f() : nullptr;
}

void nbd_close(struct nbd_handle* h) {
  if (auto f = QCOWFS_NBD_REAL(nbd_close)) f(h);
}

const char* nbd_get_error(void) {
  auto f = QCOWFS_NBD_REAL(nbd_get_error);
  return f ? f() : qcowfs::io::nbd_library().error().c_str();
}

int nbd_get_errno(void) {
  auto f = QCOWFS_NBD_REAL(nbd_get_errno);
  return f ? f() : ELIBACC;
}

QCOWFS_NBD_HANDLE_FN(int, nbd_add_meta_context, (struct nbd_handle * h, const char* name), (h, name))
QCOWFS_NBD_HANDLE_FN(int, nbd_connect_uri, (struct nbd_handle * h, const char* uri), (h, uri))
QCOWFS_NBD_HANDLE_FN(int, nbd_aio_connect_uri, (struct nbd_handle * h, const char* uri), (h, uri))
QCOWFS_NBD_HANDLE_FN(int64_t, nbd_aio_block_status,
                     (struct nbd_handle * h, uint64_t count, uint64_t offset, nbd_extent_callback extent_callback,
                      nbd_completion_callback completion_callback, uint32_t flags),
                     (h, count, offset, extent_callback, completion_callback, flags))
QCOWFS_NBD_HANDLE_FN(int64_t, nbd_aio_flush,
                     (struct nbd_handle * h, nbd_completion_callback completion_callback, uint32_t flags),
                     (h, completion_callback, flags))
QCOWFS_NBD_HANDLE_FN(int64_t, nbd_aio_pread,
                     (struct nbd_handle * h, void* buf, size_t count, uint64_t offset,
                      nbd_completion_callback completion_callback, uint32_t flags),
                     (h, buf, count, offset, completion_callback, flags))
QCOWFS_NBD_HANDLE_FN(int64_t, nbd_aio_pwrite,
                     (struct nbd_handle * h, const void* buf, size_t count, uint64_t offset,
                      nbd_completion_callback completion_callback, uint32_t flags),
                     (h, buf, count, offset, completion_callback, flags))
QCOWFS_NBD_HANDLE_FN(int64_t, nbd_aio_trim,
                     (struct nbd_handle * h, uint64_t count, uint64_t offset,
                      nbd_completion_callback completion_callback, uint32_t flags),
                     (h, count, offset, completion_callback, flags))
QCOWFS_NBD_HANDLE_FN(int64_t, nbd_aio_zero,
                     (struct nbd_handle * h, uint64_t count, uint64_t offset,
                      nbd_completion_callback completion_callback, uint32_t flags),
                     (h, count, offset, completion_callback, flags))
// Its answer is a set of direction bits: none without a handle.
unsigned nbd_aio_get_direction(struct nbd_handle* h) {
  auto f = QCOWFS_NBD_REAL(nbd_aio_get_direction);
  return f ? f(h) : 0;
}
QCOWFS_NBD_HANDLE_FN(int, nbd_aio_get_fd, (struct nbd_handle * h), (h))
QCOWFS_NBD_HANDLE_FN(int, nbd_aio_is_closed, (struct nbd_handle * h), (h))
QCOWFS_NBD_HANDLE_FN(int, nbd_aio_is_created, (struct nbd_handle * h), (h))
QCOWFS_NBD_HANDLE_FN(int, nbd_aio_is_dead, (struct nbd_handle * h), (h))
QCOWFS_NBD_HANDLE_FN(int, nbd_aio_is_ready, (struct nbd_handle * h), (h))
QCOWFS_NBD_HANDLE_FN(int, nbd_aio_notify_read, (struct nbd_handle * h), (h))
QCOWFS_NBD_HANDLE_FN(int, nbd_aio_notify_write, (struct nbd_handle * h), (h))
QCOWFS_NBD_HANDLE_FN(int, nbd_can_flush, (struct nbd_handle * h), (h))
QCOWFS_NBD_HANDLE_FN(int, nbd_can_meta_context, (struct nbd_handle * h, const char* metacontext), (h, metacontext))
QCOWFS_NBD_HANDLE_FN(int, nbd_can_trim, (struct nbd_handle * h), (h))
QCOWFS_NBD_HANDLE_FN(int, nbd_can_zero, (struct nbd_handle * h), (h))
QCOWFS_NBD_HANDLE_FN(int64_t, nbd_get_size, (struct nbd_handle * h), (h))
QCOWFS_NBD_HANDLE_FN(int, nbd_is_read_only, (struct nbd_handle * h), (h))
QCOWFS_NBD_HANDLE_FN(int, nbd_set_pread_initialize, (struct nbd_handle * h, bool request), (h, request))

#undef QCOWFS_NBD_HANDLE_FN
#undef QCOWFS_NBD_REAL
#undef QCOWFS_NBD_FUNCTIONS
