/* Test support (built as tests/libqcowfs_fast_cpu_clock.so), preloaded into
 * qemu-img (LD_PRELOAD) when a test has it create a LUKS
 * header: getrusage(RUSAGE_THREAD) reports a thread CPU time that runs one
 * second ahead more at every call. qemu-img calibrates PBKDF2 before it writes
 * a key slot (qcrypto_pbkdf2_count_iters: it repeats rounds until one takes
 * over 500 ms of CPU, whatever iter-time asks for, twice per header: 2-3 s of
 * CPU per image); with this clock the first round ends the calibration and the
 * header gets QEMU's minimum of 1000 iterations. Only the time of the
 * calibration changes: the image is written by qemu-img's own code.
 * Thread-safe (one atomic counter). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <sys/resource.h>

int getrusage(int who, struct rusage *usage) {
  static long calls;
  int (*real)(int, struct rusage *) = (int (*)(int, struct rusage *))dlsym(RTLD_NEXT, "getrusage");
  if (real == NULL) {
    return -1;
  }
  int r = real(who, usage);
  if (r == 0 && who == RUSAGE_THREAD) {
    usage->ru_utime.tv_sec += __atomic_add_fetch(&calls, 1, __ATOMIC_RELAXED);
  }
  return r;
}
