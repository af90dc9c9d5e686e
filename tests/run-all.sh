#!/usr/bin/env bash
# Sets up a fresh Debian 12 machine and runs every qcowfs test:
#   1. installs build and test dependencies (tests/setup-deps.sh);
#   2. builds build/ with warnings as errors and runs all of ctest there
#      (the GoogleTest unit tests and every tests/integration/test_*.py file;
#      the model checker first, alone, before step 4's background build);
#   3. runs the tests of the table-cached formats (qcow2, QED, VMDK; unit and
#      integration) again in build/ with QCOWFS_TINY_CACHE=1 in the environment
#      (every metadata cache shrunk to two slices), so cache eviction paths run,
#      this time with FUSE over io_uring switched off (step 2 runs with it on);
#   4. builds build-asan/ (clang, ASan+UBSan, libFuzzer coverage: CMakePresets.json
#      "asan") and runs the unit tests, some mounts and a short fuzz of every
#      libFuzzer target there.
# Steps 2 and 3 leave CPU time unused (the integration files run one at a time
# and wait on FUSE, the disk and QEMU's tools much of it): the Debian package
# test_package.py builds and step 4's tree compile in the background meanwhile,
# at idle CPU priority (SCHED_IDLE: only CPU time no test wants).
# Needs root (or sudo) for apt, FUSE mounts and loop devices. Ends with one
# "run-all: N passed, N failed" line; exits non-zero if anything failed.
set -euo pipefail
cd "$(dirname "$0")/.."

jobs=$(nproc)
# Default per-test time limit for ctest entries without their own TIMEOUT (the
# unit tests); integration files set theirs in tests/CMakeLists.txt.
unit_timeout=300
log_dir=$(mktemp -d /var/tmp/qcowfs-run-all.XXXXXX)
# FUSE over io_uring (Linux 6.14+) needs the fuse module parameter enable_uring;
# set_fuse_uring switches it for the runs below, and the old value comes back at exit.
uring_param=/sys/module/fuse/parameters/enable_uring
uring_old=$(cat "$uring_param" 2>/dev/null || true)
bg_pid=
restore() {
  if [ -n "$bg_pid" ]; then kill -- -"$bg_pid" 2>/dev/null || true; fi
  rm -rf "$log_dir"
  if [ -n "$uring_old" ]; then echo "$uring_old" > "$uring_param" 2>/dev/null || true; fi
}
trap restore EXIT
set_fuse_uring() {
  if [ -w "$uring_param" ]; then
    echo "$1" > "$uring_param"
    echo "=== fuse.enable_uring=$1"
  else
    echo "=== $uring_param not writable: mounts use /dev/fuse"
  fi
}
passed=0
failed=0

# Runs ctest with the given arguments, keeps its output, and adds its tally.
run_ctest() {
  local label=$1; shift
  local log="$log_dir/$label.log"
  echo "=== ctest ($label): ctest $* (at ${SECONDS}s)"
  set +e
  # -j: the unit tests share the CPUs; the integration files are RUN_SERIAL,
  # so each still runs alone.
  ctest "$@" -j"$jobs" --output-on-failure --timeout "$unit_timeout" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  set -e
  # "100% tests passed, 0 tests failed out of 57"
  local line total bad
  line=$(grep -E '[0-9]+% tests passed, [0-9]+ tests? failed out of [0-9]+' "$log" | tail -1 || true)
  if [ -z "$line" ]; then
    echo "=== ctest ($label) printed no summary (exit $rc): counted as one failure"
    failed=$((failed + 1))
    return
  fi
  total=$(sed -E 's/.* out of ([0-9]+).*/\1/' <<<"$line")
  bad=$(sed -E 's/.*passed, ([0-9]+) tests? failed.*/\1/' <<<"$line")
  passed=$((passed + total - bad))
  failed=$((failed + bad))
  if [ "$rc" -ne 0 ] && [ "$bad" -eq 0 ]; then
    failed=$((failed + 1))  # ctest failed without a failing test: still a failure
  fi
}

# Configures and builds one tree; a failed build ends the run with the summary line.
build() {
  local dir=$1; shift
  echo "=== configure and build $dir (at ${SECONDS}s)"
  # RelWithDebInfo's optimisation without its -g: debug info is almost half the
  # compile time; the sanitizer tree keeps line tables only, enough for its reports.
  # Unity sources for the libraries (the unit tests stay one file each): 195 s
  # instead of 275 s for this tree on 2 CPUs. Trees of one's own default to
  # one object per source, which also checks that each includes what it uses.
  if ! { cmake -S . -B "$dir" -DQCOWFS_WERROR=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
           "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -DNDEBUG" -DCMAKE_UNITY_BUILD=ON "$@" &&
         cmake --build "$dir" -j"$jobs"; }; then
    echo "run-all: $passed passed, $((failed + 1)) failed (the build in $dir failed)"
    exit 1
  fi
}

bash tests/setup-deps.sh
modprobe fuse 2>/dev/null || true

# Everything over FUSE over io_uring (the default transport where the kernel
# allows it); the tiny-cache rerun of the qcow2 tests goes over /dev/fuse, so
# both transports carry the whole qcow2 matrix.
build build

# The model checker first, before the background builds start: it is a long
# chain of FUSE round trips, and even a SCHED_IDLE compile beside it doubled
# its time (84 -> 168 s alone on an idle 2-vCPU machine, 231 s in a full run).
set_fuse_uring Y
model_check='^integration\.test_model_check$'
run_ctest model-check --test-dir build -R "$model_check"

# In the background, at idle priority, in a process group of its own (setsid):
# the package test_package.py builds (tests/support/build-test-deb.sh, the same
# script and flags, into the same build/deb: the test's own run then compiles
# nothing, or waits on the script's lock while this one finishes), then the
# sanitizer tree of step 4. Their output goes to a log printed after step 3.
bg_log="$log_dir/background-builds.log"
idle=(chrt --idle 0)
"${idle[@]}" true 2>/dev/null || idle=(nice -n 19)  # where SCHED_IDLE is not allowed
echo "=== background, ${idle[*]}: the package in build/deb, then build-asan (at ${SECONDS}s)"
setsid -w "${idle[@]}" bash -c '
  echo "=== build the package in build/deb (tests/support/build-test-deb.sh)"
  tests/support/build-test-deb.sh build/deb || echo "=== the package build failed (test_package.py builds it again and reports it)"
  echo "=== configure and build build-asan (clang, ASan+UBSan, fuzz targets)"
  rc=0
  { cmake --preset asan && cmake --build build-asan -j"$1"; } || rc=$?
  echo "$rc" > "$2"
  echo "=== background builds finished ($(( $(date +%s) - $3 ))s after the run began)"
' bg-builds "$jobs" "$log_dir/asan-build.rc" "$(( $(date +%s) - SECONDS ))" > "$bg_log" 2>&1 &
bg_pid=$!

run_ctest main --test-dir build -E "$model_check"

# Only what the qcow2 tests run: the daemon and the io/ and image/ unit tests.
set_fuse_uring N
# (Not the tools' tests: create and check do not go through the caches.)
QCOWFS_TINY_CACHE=1 run_ctest tiny-cache --test-dir build -R '[Qq]cow2|[Qq]ed|[Vv]mdk|TableCache' -E '^integration\.test_tools_'
set_fuse_uring Y

# ASan+UBSan (CMakePresets.json "asan", docs/SANITIZERS.md): every unit test,
# the hostile-image, locking and injection mounts against the sanitized daemon,
# and fuzz.short (docs/FUZZING.md): the same clang tree carries libFuzzer's
# coverage instrumentation, so the library is compiled once for both.
# The default stack is enough: Task's handoff (io/task.h) keeps synchronous
# awaits from nesting even where sanitizers prevent tail calls.
echo "=== waiting for the background builds (at ${SECONDS}s)"
wait "$bg_pid" || true
bg_pid=
cat "$bg_log"
echo "=== background builds done (at ${SECONDS}s)"
if [ "$(cat "$log_dir/asan-build.rc" 2>/dev/null)" = 0 ]; then
  run_ctest asan-unit --preset asan -E '^(fuzz|integration)\.'
  run_ctest asan-mounts --preset asan -R '^integration\.test_(hostile|locking|injection)$'
  run_ctest asan-fuzz --preset asan -R '^fuzz\.short$'
else
  echo "=== the asan build failed: counted as one failure"
  failed=$((failed + 1))
fi

# The names of the failed tests again, next to the summary, so the end of the
# log alone tells what failed.
if [ "$failed" -ne 0 ]; then
  for log in "$log_dir"/*.log; do
    [ -e "$log" ] || continue
    if grep -q 'The following tests FAILED' "$log"; then
      echo "=== failed in $(basename "$log" .log):"
      sed -n '/The following tests FAILED/,/^Errors while running/p' "$log" | grep -E '^[[:space:]]+[0-9]+ - ' || true
    fi
  done
  # Why they failed: the first assertion lines and pytest's short summary of
  # each failed test (the CI report keeps only the end of the log).
  for log in "$log_dir"/*.log; do
    [ -e "$log" ] || continue
    grep -E '^E   ' "$log" | head -n 12 | cut -c1-300 || true
    grep -E '^(FAILED|ERROR) |^\[  FAILED  \]' "$log" | head -n 20 | cut -c1-300 || true
  done
fi
echo "run-all: $passed passed, $failed failed (in ${SECONDS}s)"
[ "$failed" -eq 0 ]
