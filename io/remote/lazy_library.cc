#include "io/remote/lazy_library.h"

#include <dlfcn.h>

#include <fmt/format.h>

namespace qcowfs::io {

LazyLibrary::LazyLibrary(const char* soname, const char* package, std::span<const char* const> names)
    : names_(names) {
  void* handle = dlopen(soname, RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    const char* why = dlerror();
    error_ = fmt::format("cannot load {} (is the {} package installed?): {}", soname, package,
                         why ? why : "unknown error");
    return;
  }
  std::vector<void*> found;
  found.reserve(names.size());
  for (const char* name : names) {
    dlerror();
    void* s = dlsym(handle, name);
    if (!s) {
      const char* why = dlerror();
      error_ = fmt::format("{} has no function {} (is the {} package too old?): {}", soname, name, package,
                           why ? why : "null symbol");
      dlclose(handle);
      return;
    }
    found.push_back(s);
  }
  symbols_ = std::move(found);
}

}  // namespace qcowfs::io
