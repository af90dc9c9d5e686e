// Linked into every unit-test binary (tests/CMakeLists.txt): glibc malloc
// keeps freed memory instead of handing each large block back to the kernel.
// The crash-point tests copy whole images (8-16 MiB vectors: MemFile's
// crash images, files for qemu-img) hundreds of times; by default each copy
// is a fresh mmap, so every page faults in zeroed and is unmapped again: most
// of those tests' CPU time. Blocks up to 32 MiB come from the heap and the
// heap is not trimmed. Changes nothing a test checks (no test looks at the
// process's memory); ASan's allocator ignores mallopt.
#include <malloc.h>

namespace {

[[maybe_unused]] const bool kTuned = [] {
  mallopt(M_MMAP_THRESHOLD, 32 << 20);  // glibc's upper limit for it (HEAP_MAX_SIZE / 2)
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  return true;
}();

}  // namespace
